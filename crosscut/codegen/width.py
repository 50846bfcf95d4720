"""Width splitting of one stage over a group of devices (cross-shaped plans).

Two rewrites of a stage's GraphModule, both exact against eager mode:

* :func:`channel_split` (model parallel, Krizhevsky's columns): every
  ``Conv2d`` (``groups == 1``) and ``Linear`` becomes one shard module per
  device holding its slice of the output channels (weights and bias sliced from
  the original parameters, so each device holds only its shard). Per-channel
  ops (batch norm, activations, pooling, element-wise ``add``/``mul`` of
  shards with the same layout) run shard by shard on their device. Any other
  op needs the whole value: an explicit :func:`all_gather` node concatenates
  the shards on the group's leader, and a conv/linear shard that reads a whole
  value gets it through an explicit :func:`broadcast` node. Their backward is
  autograd's: the gather's gradient is sliced back to the shards, the
  broadcast's gradients are summed (a reduce) on the leader. Dropout runs
  whole on the leader so it draws the same random numbers as eager mode.
  Uneven shards are fine (``ceil``/``floor`` split, as ``torch.tensor_split``);
  a layer with fewer channels than devices stays whole on the leader.
* :class:`BatchSplitStage` (a replicated stage, Mariana's worker group): every
  device runs the stage on its share of the micro-batch (``tensor_split``
  along dim 0, uneven allowed). The parameters live once, on the leader; each
  forward broadcasts them to the replicas with the differentiable
  ``Tensor.to``, so backward reduces (sums) every replica's gradient into the
  leader's ``.grad`` — the all-reduce of data parallelism, and the result
  equals eager because the loss sees the concatenated batch. Batch norm in
  training normalises each share with its own statistics (as micro-batches
  do), and only the leader's replica updates the running statistics.

How the group's devices are driven: a batch-split stage runs its shares
concurrently, one thread per group device (the leader's share on the calling
thread, the others on threads the stage owns; see
:mod:`crosscut.codegen.share_threads` for what keeps that exact: per-share
module views, a fixed-order gradient reduce, sequential shares when the stage
draws random numbers). A channel-split stage is one graph whose shard ops are
issued from the stage's single thread: on CUDA kernel launches are
asynchronous, so the group's devices still compute concurrently; on CPU the
shards run one after another.

Collectives are recorded as :class:`Collective` records with byte counts (from
the shape metadata of the trace; 0 where there is none).
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call

from crosscut.codegen.attrs import get_attr, set_attr
from crosscut.codegen.share_threads import (
    DeviceThread,
    draws_random,
    module_view,
    next_call,
    replicate,
    share_scope,
    stop_threads,
    thread_state,
)
from crosscut.errors import CodegenError, RuntimeError_

__all__ = [
    "BatchSplitStage",
    "ChannelSplit",
    "Collective",
    "all_gather",
    "broadcast",
    "channel_split",
    "shard_bounds",
]

_SPLIT = (nn.Conv2d, nn.Linear)
_PER_CHANNEL_ANY = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.SiLU,
    nn.GELU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.ELU,
    nn.Identity,
)
_PER_CHANNEL_CONV = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.BatchNorm2d,
)
_ELEMENTWISE_FN = {
    operator.add,
    operator.iadd,
    operator.mul,
    operator.imul,
    torch.add,
    torch.mul,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    nn.functional.relu,
    nn.functional.relu6,
    nn.functional.silu,
    nn.functional.hardswish,
}
_CONV_FN = {
    nn.functional.adaptive_avg_pool2d,
    nn.functional.max_pool2d,
    nn.functional.avg_pool2d,
}
_ELEMENTWISE_METHODS = {"relu", "relu_", "add", "add_", "mul", "mul_", "sigmoid", "tanh"}


def all_gather(dim: int, device: str, *shards: torch.Tensor) -> torch.Tensor:
    """The whole value on ``device`` from its channel shards (an explicit gather op)."""
    return torch.cat([s.to(device) for s in shards], dim)


def broadcast(value: torch.Tensor, device: str) -> torch.Tensor:
    """A whole value copied to one more device of the group (backward: a reduce)."""
    return value.to(device)


def shard_bounds(channels: int, width: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each shard: sizes differ by at most one, larger ones first."""
    base, extra = divmod(channels, width)
    out, start = [], 0
    for i in range(width):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class Collective:
    """One collective a group stage runs per micro-batch (forward direction)."""

    kind: str  # "all_gather" | "broadcast" | "scatter" | "gather" | "all_reduce"
    value: str  # fx node (or parameter set) it moves
    nbytes: int  # bytes of the whole value
    devices: tuple[str, ...]


@dataclass
class _Sharded:
    nodes: list[fx.Node]  # one per device
    dim: int  # channel dim of the layout: 1 (conv maps) or -1 (linear features)
    bounds: list[tuple[int, int]]


@dataclass
class ChannelSplit:
    """The rewritten stage and where every original parameter's shards went."""

    module: fx.GraphModule
    # local name in the original stage module -> (local shard names, cat dim or None)
    shards: dict[str, tuple[list[str], int | None]] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    shape, dtype = getattr(val, "shape", None), getattr(val, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        return 0
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def _rank(node: fx.Node) -> int | None:
    val = node.meta.get("val", node.meta.get("tensor_meta"))
    shape = getattr(val, "shape", None)
    return len(shape) if shape is not None else None


class _Rewriter:
    """Builds the channel-split graph node by node (module docstring)."""

    def __init__(self, sub: fx.GraphModule, devices: Sequence[torch.device]) -> None:
        self.sub = sub
        self.devices = [str(d) for d in devices]
        self.modules = dict(sub.named_modules())
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.whole: dict[fx.Node, fx.Node] = {}
        self.sharded: dict[fx.Node, _Sharded] = {}
        self.copies: dict[tuple[fx.Node, int], fx.Node] = {}
        self.out = ChannelSplit(module=sub)

    # ---- values --------------------------------------------------------------
    def value(self, n: fx.Node) -> fx.Node:
        """The whole value of ``n`` on the leader, gathering its shards if needed."""
        if n not in self.whole:
            sh = self.sharded[n]
            self.whole[n] = self.graph.call_function(
                all_gather, (sh.dim, self.devices[0], *sh.nodes)
            )
            self._record("all_gather", n)
        return self.whole[n]

    def on(self, n: fx.Node, i: int) -> fx.Node:
        """The whole value of ``n`` on device ``i`` (broadcast from the leader)."""
        whole = self.value(n)
        if i == 0:
            return whole
        if (n, i) not in self.copies:
            if not any(key[0] is n for key in self.copies):
                self._record("broadcast", n)
            self.copies[(n, i)] = self.graph.call_function(broadcast, (whole, self.devices[i]))
        return self.copies[(n, i)]

    def _record(self, kind: str, n: fx.Node) -> None:
        self.out.collectives.append(Collective(kind, n.name, _nbytes(n), tuple(self.devices)))

    # ---- modules ---------------------------------------------------------------
    def _register(self, name: str, mod: nn.Module) -> str:
        safe = name.replace(".", "_")
        self.root.add_module(safe, mod)
        return safe

    def _shard_module(self, target: str, mod: nn.Module, i: int, lo: int, hi: int) -> str:
        """A copy of ``mod`` holding output channels ``[lo, hi)`` on device ``i``."""
        dev = torch.device(self.devices[i])
        shard = copy.copy(mod)
        shard._parameters = dict(mod._parameters)  # type: ignore[assignment]
        shard._buffers = dict(mod._buffers)  # type: ignore[assignment]
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                piece = p.detach()[lo:hi].clone().to(dev)
                shard._parameters[pname] = nn.Parameter(piece, requires_grad=p.requires_grad)
        for bname, b in list(mod._buffers.items()):
            if b is not None:
                piece = b[lo:hi] if b.dim() > 0 else b
                shard._buffers[bname] = piece.detach().clone().to(dev)
        for attr in ("out_channels", "out_features", "num_features"):
            if hasattr(shard, attr):
                setattr(shard, attr, hi - lo)
        name = self._register(f"{target}__shard{i}", shard)
        for local in [*mod._parameters, *mod._buffers]:
            if getattr(mod, local) is None:
                continue
            dim = None if getattr(mod, local).dim() == 0 else 0
            names, _ = self.out.shards.setdefault(f"{target}.{local}", ([], dim))
            names.append(f"{name}.{local}")
        return name

    # ---- nodes -----------------------------------------------------------------
    def node(self, n: fx.Node) -> None:
        if n.op == "placeholder":
            self.whole[n] = self.graph.placeholder(n.name)
        elif n.op == "get_attr":
            target = str(n.target)
            set_attr(self.root, target, get_attr(self.sub, target))
            self.whole[n] = self.graph.get_attr(target)
        elif n.op == "output":
            self.graph.output(fx.map_arg(n.args[0], self.value))
        elif not self._try_split(n) and not self._try_per_channel(n):
            self._whole_op(n)

    def _ensure_path(self, path: list[str]) -> nn.Module:
        mod = self.root
        for p in path:
            if not hasattr(mod, p):
                mod.add_module(p, nn.Module())
            mod = getattr(mod, p)
        return mod

    def _whole_op(self, n: fx.Node) -> None:
        if n.op == "call_module":
            target = str(n.target)
            *path, leaf = target.split(".")
            owner = self._ensure_path(path)
            if not hasattr(owner, leaf):
                owner.add_module(leaf, self.modules[target])
        new = self.graph.node_copy(n, self.value)
        self.whole[n] = new

    def _try_split(self, n: fx.Node) -> bool:
        if n.op != "call_module" or n.kwargs or len(n.args) != 1:
            return False
        mod = self.modules[str(n.target)]
        if not isinstance(mod, _SPLIT) or (isinstance(mod, nn.Conv2d) and mod.groups != 1):
            return False
        src = n.args[0]
        channels = mod.out_channels if isinstance(mod, nn.Conv2d) else mod.out_features
        if not isinstance(src, fx.Node) or channels < len(self.devices):
            return False
        bounds = shard_bounds(channels, len(self.devices))
        nodes = []
        for i, (lo, hi) in enumerate(bounds):
            name = self._shard_module(str(n.target), mod, i, lo, hi)
            nodes.append(self.graph.call_module(name, (self.on(src, i),)))
        self.sharded[n] = _Sharded(nodes, 1 if isinstance(mod, nn.Conv2d) else -1, bounds)
        return True

    def _layout(self, n: fx.Node) -> _Sharded | None:
        """The common shard layout of ``n``'s tensor inputs, if all are sharded alike."""
        ins = n.all_input_nodes
        if not ins or any(u not in self.sharded for u in ins):
            return None
        first = self.sharded[ins[0]]
        for u in ins[1:]:
            if (self.sharded[u].dim, self.sharded[u].bounds) != (first.dim, first.bounds):
                return None
        return first

    def _try_per_channel(self, n: fx.Node) -> bool:
        lay = self._layout(n)
        if lay is None:
            return False
        conv_layout = lay.dim == 1
        if n.op == "call_module":
            mod = self.modules[str(n.target)]
            if isinstance(mod, nn.BatchNorm1d):
                ok = lay.dim == -1 and _rank(n) == 2
            else:
                ok = isinstance(mod, _PER_CHANNEL_ANY) or (
                    conv_layout and isinstance(mod, _PER_CHANNEL_CONV)
                )
            if not ok or len(n.args) != 1 or n.kwargs:
                return False
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                names = [
                    self._shard_module(str(n.target), mod, i, lo, hi)
                    for i, (lo, hi) in enumerate(lay.bounds)
                ]
            else:
                names = [self._register(str(n.target), mod)] * len(self.devices)
            nodes = [self.graph.call_module(names[i], (lay.nodes[i],)) for i in range(len(names))]
        elif n.op in ("call_function", "call_method"):
            fn_ok = n.op == "call_function" and (
                n.target in _ELEMENTWISE_FN or (conv_layout and n.target in _CONV_FN)
            )
            if not fn_ok and not (n.op == "call_method" and n.target in _ELEMENTWISE_METHODS):
                return False
            nodes = []
            for i in range(len(self.devices)):

                def pick(u: fx.Node, i: int = i) -> fx.Node:
                    return self.sharded[u].nodes[i]

                args = fx.map_arg(n.args, pick)
                kwargs = fx.map_arg(n.kwargs, pick)
                nodes.append(self.graph.create_node(n.op, n.target, args, kwargs))  # type: ignore[arg-type]
        else:
            return False
        self.sharded[n] = _Sharded(nodes, lay.dim, lay.bounds)
        return True


def channel_split(sub: fx.GraphModule, devices: Sequence[torch.device]) -> ChannelSplit:
    """Rewrite stage ``sub`` to run channel-split over ``devices`` (leader first).

    ``sub``'s parameters are not modified; shard parameters are copies on their
    devices, whole ones are shared with ``sub``. ``shards`` maps every sharded
    parameter/buffer (local name in ``sub``) to its shards' local names in the
    result and the dim to concatenate them on (``None``: replicated scalars).
    """
    if len(devices) < 2:
        raise CodegenError(
            "a channel split needs a group of at least two devices",
            value=[str(d) for d in devices],
            remedy="use split 'none' for a one-device stage",
        )
    rw = _Rewriter(sub, devices)
    for n in sub.graph.nodes:
        rw.node(n)
    rw.graph.lint()
    gm = fx.GraphModule(rw.root, rw.graph)
    rw.out.module = gm
    return rw.out


class BatchSplitStage(nn.Module):
    """A stage replicated over a device group, each device on its share of the batch.

    Shares run concurrently, one thread per group device: the leader's share
    on the calling thread (the stage's worker thread in the local executor),
    every other share on a persistent :class:`DeviceThread` this stage owns
    (created on first use, stopped by :meth:`close` or when the stage is
    collected). The threads belong to the stage rather than to the executor
    because the stage is what knows its group: it is called the same way
    inline, from an executor worker or directly, and the executor stays a
    one-thread-per-stage scheduler that never looks inside a stage.

    Results are those of running the shares one after another (``parallel=
    False``, kept for comparison and benchmarks): outputs are concatenated in
    share order; each share computes the same ops on the same tensors; a
    share's ``functional_call`` swaps tensors only in its own
    :func:`module_view`; the backward runs wherever the caller runs it. A stage
    that may draw random numbers in training (dropout, stochastic depth) runs
    its shares sequentially, so each share draws today's masks from the shared
    generator. On CUDA a share's thread adopts the caller's current device
    streams (current streams are per thread), so every kernel lands on the
    stream it would have used from the stage's thread. An exception in any
    share is re-raised on the caller's thread, after every share finished, as
    :class:`~crosscut.errors.RuntimeError_` naming the share and its device.
    """

    def __init__(
        self,
        inner: fx.GraphModule,
        devices: Sequence[torch.device],
        mutated: Sequence[int] = (),
        *,
        parallel: bool = True,
    ) -> None:
        """``mutated``: positions of inputs the stage changes in place (their shares are
        copied, since an in-place op on a view of the input would corrupt autograd).
        ``parallel``: run the shares concurrently (the default) or one after another."""
        super().__init__()
        self.mutated = set(mutated)
        if len(devices) < 2:
            raise CodegenError(
                "a batch split needs a group of at least two devices",
                value=[str(d) for d in devices],
                remedy="use split 'none' for a one-device stage",
            )
        self.inner = inner
        self.devices = [torch.device(d) for d in devices]
        self.parallel = parallel
        self._threads: list[DeviceThread] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def forward(self, *args: Any) -> tuple[Any, ...]:
        batch = next(
            (int(a.shape[0]) for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None
        )
        if batch is None:
            raise CodegenError(
                "a batch-split stage needs a batch-major tensor input",
                value=[type(a).__name__ for a in args],
                remedy="split this stage by channel, or do not split it",
            )
        w = min(len(self.devices), batch)
        parts = [
            a.tensor_split(w, 0)
            if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch
            else None
            for a in args
        ]
        params = dict(self.inner.named_parameters())
        buffers = dict(self.inner.named_buffers())
        call = next_call()
        replicas = replicate(params, self.devices[:w])  # on this thread: one reduce node

        def share(i: int, module: nn.Module) -> tuple[Any, ...]:
            dev = self.devices[i]
            with share_scope(call, i):
                state: dict[str, torch.Tensor] = dict(replicas[i])
                for k, b in buffers.items():  # only the leader's replica updates running stats
                    state[k] = b if i == 0 else b.to(dev, copy=True)
                mine = [
                    p[i].to(dev, copy=j in self.mutated)
                    if p is not None
                    else (a.to(dev) if isinstance(a, torch.Tensor) else a)
                    for j, (p, a) in enumerate(zip(parts, args))
                ]
                return tuple(functional_call(module, state, tuple(mine)))

        if self.parallel and not draws_random(self.inner):
            outs = self._concurrent(share, w, batch)
        else:
            outs = []
            for i in range(w):
                try:
                    outs.append(share(i, self.inner))
                except Exception as exc:
                    raise self._share_error(i, w, batch, exc) from exc
        return tuple(self._merge(j, [o[j] for o in outs]) for j in range(len(outs[0])))

    def _concurrent(
        self, share: Callable[[int, nn.Module], tuple[Any, ...]], w: int, batch: int
    ) -> list[tuple[Any, ...]]:
        """Shares 1.. on their device threads, share 0 here; results in share order."""
        threads = self._ensure_threads()
        views = [module_view(self.inner) for _ in range(1, w)]  # before share 0 swaps tensors
        enter = thread_state(self.devices)
        pending = []
        for i in range(1, w):

            def job(i: int = i) -> tuple[Any, ...]:
                with enter(self.devices[i]):
                    return share(i, views[i - 1])

            pending.append(threads[i - 1].submit(job))
        results: list[tuple[Any, ...] | None] = [None] * w
        errors: list[BaseException | None] = [None] * w
        try:
            results[0] = share(0, self.inner)
        except BaseException as leader_exc:
            errors[0] = leader_exc
        for i, res in enumerate(pending, start=1):
            res.done.wait()  # a plain join: every job sets it, also when it raised
            results[i], errors[i] = res.value, res.error
        for i, err in enumerate(errors):  # the first failed share, in share order
            if err is not None:
                if not isinstance(err, Exception):
                    raise err
                raise self._share_error(i, w, batch, err) from err
        return [r for r in results if r is not None]

    def _share_error(self, i: int, w: int, batch: int, exc: Exception) -> RuntimeError_:
        lo, hi = shard_bounds(batch, w)[i]  # the rows tensor_split gave this share
        return RuntimeError_(
            f"share {i} of {w} of a batch-split stage (rows {lo}:{hi} on {self.devices[i]}) "
            f"failed: {type(exc).__name__}: {exc}",
            value={"share": i, "device": str(self.devices[i]), "rows": [lo, hi]},
            remedy="the share and device locate the failure; run the stage unsplit to compare",
        )

    def _ensure_threads(self) -> list[DeviceThread]:
        if self._threads is None:
            self._threads = [
                DeviceThread(f"crosscut-share{i}-{d}") for i, d in enumerate(self.devices) if i
            ]
            self._finalizer = weakref.finalize(self, stop_threads, self._threads)
        return self._threads

    def close(self) -> None:
        """Stop the share threads (daemons, stopped at collection too; a later call restarts)."""
        if self._finalizer is not None:
            self._finalizer()
        self._threads, self._finalizer = None, None

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the threads behind (they start again on first use)."""
        state = dict(self.__dict__)
        state["_threads"], state["_finalizer"] = None, None
        return state

    def _merge(self, j: int, values: list[Any]) -> Any:
        lead = self.devices[0]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            return torch.cat([v.to(lead) for v in values], 0)
        if all(v == first for v in values[1:]) if not isinstance(first, torch.Tensor) else False:
            return first
        raise CodegenError(
            f"output {j} of a batch-split stage is not batch-major, so its shares cannot "
            "be concatenated",
            value=repr(first)[:80],
            remedy="cut the stage elsewhere, split it by channel, or do not split it",
        )
