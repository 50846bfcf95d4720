"""Channel splitting of one stage over a group of devices (cross-shaped plans).

The model-parallel half of a width split (the data-parallel half, a stage
replicated over the group, is :mod:`crosscut.runtime.batch_split`), exact
against eager mode:

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
  a layer with fewer channels than devices stays whole on the leader. Only
  torch's own classes without hooks are sharded or run shard by shard
  (``frontend/stock.py``): a hook or a parametrization sees the whole value.
  A value may exist twice, as shards and as a gathered copy; an in-place
  write goes to the one later ops read (:meth:`_Rewriter._written`).

A channel-split stage is one graph whose shard ops are issued from the
stage's single thread: on CUDA kernel launches are asynchronous, so the
group's devices still compute concurrently; on CPU the shards run one after
another.

Collectives are recorded as :class:`Collective` records with byte counts (from
the shape metadata of the trace; 0 where there is none).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from crosscut.codegen.dotted_attrs import get_attr, set_attr
from crosscut.errors import CodegenError
from crosscut.frontend.alias import MUTATES, inplace_target
from crosscut.frontend.stock import stock_module
from crosscut.ir.program import Collective

__all__ = [
    "ChannelSplit",
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

    def __init__(
        self, sub: fx.GraphModule, devices: Sequence[torch.device], whole_only: set[int]
    ) -> None:
        self.sub = sub
        self.whole_only = whole_only  # ids of tensors whose modules run whole (_clashes)
        # (id(module), device) -> its shard module's name; (id(tensor), device) -> its piece:
        # a module called twice, or a weight two modules share, is sharded once
        self.shard_names: dict[tuple[int, int], str] = {}
        self.pieces: dict[tuple[int, int], tuple[int, int, torch.Tensor]] = {}
        self.devices = [str(d) for d in devices]
        self.modules = dict(sub.named_modules())
        self.by_name = {n.name: n for n in sub.graph.nodes}
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

    def _shardable(self, mod: nn.Module) -> bool:
        """``mod`` may be cut into shards: none of its tensors must also be read whole."""
        own = [*mod._parameters.values(), *mod._buffers.values()]
        return not any(id(t) in self.whole_only for t in own if t is not None)

    def _piece(self, t: torch.Tensor, i: int, lo: int, hi: int) -> torch.Tensor:
        """Device ``i``'s piece of ``t``: one per tensor, however many modules hold it."""
        if (id(t), i) in self.pieces:
            plo, phi, piece = self.pieces[(id(t), i)]
            if (plo, phi) != (lo, hi):
                raise CodegenError(
                    "a tensor two modules share is cut into shards of different bounds",
                    value={"first": (plo, phi), "then": (lo, hi), "device": self.devices[i]},
                    remedy="report this model; compile without cross_shaped=True meanwhile",
                )
            return piece
        dev = torch.device(self.devices[i])
        if isinstance(t, nn.Parameter):
            new: torch.Tensor = nn.Parameter(
                t.detach()[lo:hi].clone().to(dev), requires_grad=t.requires_grad
            )
        else:
            new = (t[lo:hi] if t.dim() > 0 else t).detach().clone().to(dev)
        self.pieces[(id(t), i)] = (lo, hi, new)
        return new

    def _shard_module(self, target: str, mod: nn.Module, i: int, lo: int, hi: int) -> str:
        """A copy of ``mod`` holding output channels ``[lo, hi)`` on device ``i``.

        A module called twice gets one shard per device (the second call reuses
        it); a tensor tied between modules one piece per device, so a tie holds.
        """
        if (id(mod), i) in self.shard_names:
            return self.shard_names[(id(mod), i)]
        shard = copy.copy(mod)
        shard._parameters = dict(mod._parameters)  # type: ignore[assignment]
        shard._buffers = dict(mod._buffers)  # type: ignore[assignment]
        for pname, p in list(mod._parameters.items()):
            if p is not None:
                shard._parameters[pname] = self._piece(p, i, lo, hi)  # type: ignore[assignment]
        for bname, b in list(mod._buffers.items()):
            if b is not None:
                shard._buffers[bname] = self._piece(b, i, lo, hi)
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
        self.shard_names[(id(mod), i)] = name
        return name

    def clashes(self) -> set[int]:
        """Ids of sharded tensors the rewritten stage also reads whole.

        A module that runs whole (a call with keywords, a hooked module) or a
        ``get_attr`` can read the same parameter as a module cut into shards;
        the shards are copies, so the tie would break silently: two gradients,
        one tensor updated. :func:`channel_split` rewrites again with those
        modules whole.
        """
        cut = {key[0] for key in self.pieces}
        held: list[object] = []
        for _name, m in self.root.named_modules(remove_duplicate=False):
            held += [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]
        whole = {id(t) for t in held if isinstance(t, torch.Tensor)}
        whole -= {id(piece) for _lo, _hi, piece in self.pieces.values()}
        return cut & whole

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
        else:
            written = self._written(n)
            if any(m in self.whole for m in written):
                self._whole_op(n)  # the value has a whole copy: write that one
            elif not self._try_split(n) and not self._try_per_channel(n):
                self._whole_op(n)
            if n in self.whole:  # written whole: its shards are stale from here on
                for m in written:
                    self.sharded.pop(m, None)

    def _written(self, n: fx.Node) -> list[fx.Node]:
        """The values ``n`` writes in place, directly or through a view (``frontend/alias.py``).

        A value may exist twice in a channel-split stage, as shards and as the
        copy an all-gather made; a write reaches only one of them. So a write
        runs on the whole copy once there is one (views of it may be read
        later) and the shards are dropped after a whole write: every later
        reader then sees the written value, as in eager mode.
        """
        names = set(n.meta.get(MUTATES, []))
        target = inplace_target(n, self.modules)
        if target is not None:
            names.add(target.name)
        return [self.by_name[m] for m in sorted(names) if m in self.by_name]

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
            # a get_attr of one of its tensors may have made a holder at its path first:
            # the module replaces it (the holder's tensors are the module's own)
            if owner._modules.get(leaf) is not self.modules[target]:
                owner._modules[leaf] = self.modules[target]
        new = self.graph.node_copy(n, self.value)
        self.whole[n] = new

    def _try_split(self, n: fx.Node) -> bool:
        if n.op != "call_module" or n.kwargs or len(n.args) != 1:
            return False
        mod = self.modules[str(n.target)]
        if not stock_module(mod, _SPLIT) or (isinstance(mod, nn.Conv2d) and mod.groups != 1):
            return False
        if not self._shardable(mod):
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
            if not self._shardable(mod):
                return False
            if stock_module(mod, (nn.BatchNorm1d,)):
                ok = lay.dim == -1 and _rank(n) == 2
            else:
                ok = stock_module(mod, _PER_CHANNEL_ANY) or (
                    conv_layout and stock_module(mod, _PER_CHANNEL_CONV)
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
    whole_only: set[int] = set()
    while True:  # each pass keeps more tensors whole, so this ends
        rw = _Rewriter(sub, devices, whole_only)
        for n in sub.graph.nodes:
            rw.node(n)
        clashes = rw.clashes()
        if not clashes:
            break
        whole_only |= clashes
    rw.graph.lint()
    gm = fx.GraphModule(rw.root, rw.graph)
    rw.out.module = gm
    return rw.out
