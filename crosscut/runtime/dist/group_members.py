"""One member's share of a cross-shaped stage, as a module that runs on its own rank.

``codegen/width.py`` rewrites a grouped stage for one process that holds
every device of the group: a channel split is one graph with every member's
shard modules and explicit ``all_gather``/``broadcast`` nodes, a batch split a
:class:`~crosscut.runtime.batch_split.BatchSplitStage` around the stage. The
distributed runtime gives each member of the group a rank of its own, so this
module cuts those rewrites per member:

* **channel split** — :func:`channel_member`: each node of the rewritten
  graph belongs to one member (shard modules to theirs, per-channel ops to
  their inputs' member, everything whole to the leader, member 0). Member
  ``k`` gets a GraphModule with only its nodes, so it holds only its shard
  parameters; an ``all_gather`` becomes a receive per member on the leader
  (concatenated) and a send on each member, a ``broadcast`` to member ``k`` a
  send on the leader and a receive on member ``k``.
* **batch split** — :class:`BatchMember`: every member holds a replica of
  the stage; the leader sends each member its ``tensor_split`` share of the
  batch-major inputs (whole copies of the others), every member runs the
  stage on its share, and the leader concatenates the outputs. Gradients come
  back along the same messages; the parameter gradients of the shares are
  summed over the group by the executor at the end of the step (the loss sees
  the whole batch, so the shares' gradients add up, as the local runtime's
  differentiable ``.to`` does).

Every message is a :class:`~crosscut.runtime.dist.group_comm.SendOp` or
:class:`~crosscut.runtime.dist.group_comm.RecvOp` on the member's token chain (see
that module for why). Both ends of a message enumerate the ops from the same
graph and the same static shapes, so op indices, tags and buffers agree on
every rank without any run-time exchange. A member module's ``forward``
takes the stage inputs (the leader; nothing on the other members) and the
token last, and returns the stage outputs (the leader) and the final token
last.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from crosscut.codegen.dotted_attrs import get_attr
from crosscut.codegen.width import all_gather, broadcast
from crosscut.errors import CodegenError
from crosscut.runtime.batch_shares import batch_of, check_output, input_kind, share_bounds
from crosscut.runtime.dist.group_comm import GroupLink, RecvOp, SendOp, recv, send
from crosscut.runtime.dist.p2p import grad_free, traced_value

if TYPE_CHECKING:
    from crosscut.ir.program import Stage

__all__ = [
    "BatchMember",
    "build_member",
    "channel_member",
    "member_of_nodes",
    "propagate_shapes",
]

_SHARD = re.compile(r"__shard(\d+)$")
TOKEN = "crosscut_token"


def build_member(gm: fx.GraphModule, stage: Stage, link: GroupLink) -> nn.Module:
    """Member ``link.member``'s module of width-split ``stage`` (traced graph ``gm``).

    ``gm``'s nodes carry the traced values (``meta["val"]``) that fix every
    message's shape; ``link.ops`` is set to the number of messages.
    """
    nodes = {n.name: n for n in gm.graph.nodes}

    def traced(name: str) -> Any:
        return traced_value(nodes, name, f"{name!r} (read by cross-shaped stage {stage.index})")

    member, width = link.member, len(link.ranks)
    free = grad_free(gm)
    inputs = [(v, traced(v)) for v, _ in stage.inputs]
    if stage.split == "channel":
        assert isinstance(stage.module, fx.GraphModule)
        propagate_shapes(stage.module, [v for _, v in inputs])
        return channel_member(stage.module, member, width, link, free)
    mutated = {j for j, (v, _) in enumerate(stage.inputs) if v in stage.mutated_inputs}
    outputs = [(o, traced(o)) for o in stage.outputs]
    inner = stage.module.get_submodule("inner")
    return BatchMember(inner, member, width, link, inputs, outputs, free, mutated)


def propagate_shapes(gm: fx.GraphModule, inputs: Sequence[Any]) -> None:
    """Fill ``node.meta["val"]`` of ``gm`` with fake tensors computed from ``inputs``' shapes.

    ``inputs`` are traced values (fake tensors or constants); they are
    re-created in a private fake mode, and the module runs in eval mode so that
    no batch-norm statistics are touched (shapes are the same in both modes).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return mode.from_tensor(torch.empty(tuple(v.shape), dtype=v.dtype))
        return v

    args = [pytree.tree_map(fake, v) for v in inputs]
    flags = {m: m.training for m in gm.modules()}
    gm.eval()
    try:
        FakeTensorProp(gm, mode).propagate(*args)
    finally:
        for m, f in flags.items():
            m.training = f


def member_of_nodes(gm: fx.GraphModule, width: int) -> dict[fx.Node, int]:
    """Which member of the group runs each node of a channel-split graph.

    Rules (the shape of ``codegen/width.py``'s rewrite): a shard module
    (``…__shard{i}``) runs on member ``i``; a ``broadcast`` lands on the member
    of its readers (shard modules of one member); an ``all_gather``,
    placeholders, attributes and any op reading whole values run on the
    leader; a per-channel op runs where its inputs are. Any edge between two
    members other than through a gather or broadcast is refused (it would be
    an unannounced transfer).
    """
    where: dict[fx.Node, int] = {}
    pending: list[fx.Node] = []
    for n in gm.graph.nodes:
        match = _SHARD.search(str(n.target)) if n.op == "call_module" else None
        if n.op == "call_function" and n.target is all_gather:
            where[n] = 0
        elif n.op == "call_function" and n.target is broadcast:
            pending.append(n)
            where[n] = -1
        elif match is not None:
            where[n] = int(match.group(1))
        elif n.op in ("placeholder", "get_attr", "output"):
            where[n] = 0
        else:
            ins = {where[u] for u in n.all_input_nodes}
            where[n] = ins.pop() if len(ins) == 1 else 0
    for b in pending:
        readers = {where[u] for u in b.users}
        if len(readers) != 1 or not 0 < next(iter(readers)) < width:
            raise _odd(b, f"a broadcast read by members {sorted(readers)}")
        where[b] = readers.pop()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is all_gather:
            shards = [a for a in n.args[2:] if isinstance(a, fx.Node)]
            if [where[a] for a in shards] != list(range(width)):
                raise _odd(n, f"a gather of members {[where[a] for a in shards]}")
            continue
        for u in n.all_input_nodes:
            ok = where[u] == where[n] or (where[u] == 0 and n.target is broadcast)
            if not ok:
                raise _odd(n, f"an edge {u.name} (member {where[u]}) -> member {where[n]}")
    return where


def _odd(n: fx.Node, what: str) -> CodegenError:
    return CodegenError(
        f"the channel-split graph has {what} at node {n.name!r}; the distributed runtime "
        "cannot place it on one member",
        value=n.name,
        remedy="split this stage by batch, or do not split it (this is a crosscut bug if "
        "the graph came from codegen.width.channel_split)",
    )


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def channel_member(
    gm: fx.GraphModule, member: int, width: int, link: GroupLink, grad_free: set[str]
) -> fx.GraphModule:
    """Member ``member``'s part of channel-split stage ``gm`` (shapes in ``node.meta["val"]``).

    ``grad_free``: stage inputs whose gradient is never needed (model inputs,
    values computed from inputs only); broadcasting them sends no gradient
    back.
    """
    where = member_of_nodes(gm, width)
    out = _MemberGraph(link, member)
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "placeholder" and member == 0:
            out.env[n] = out.graph.placeholder(n.name)
    out.token = out.graph.placeholder(TOKEN)
    for n in nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out.output(n)
        elif n.op == "call_function" and n.target is all_gather:
            out.gather(n, width)
        elif n.op == "call_function" and n.target is broadcast:
            out.broadcast(n, where[n], grad_free)
        elif where[n] == member:
            out.copy(gm, n)
    link.ops = out.op
    out.graph.lint()
    return fx.GraphModule(out.root, out.graph, class_name=f"Stage{link.stage}Member{member}")


class _MemberGraph:
    """The graph :func:`channel_member` writes: member ``member``'s nodes, its messages
    (numbered ``op`` in graph order, the same on every member) and its token chain."""

    def __init__(self, link: GroupLink, member: int) -> None:
        self.link, self.member = link, member
        self.graph = fx.Graph()
        self.root: dict[str, Any] = {}
        self.env: dict[fx.Node, fx.Node] = {}
        self.token: fx.Node | None = None
        self.op = 0
        self.comms: list[nn.Module] = []

    def comm(self, mod: nn.Module, *args: Any) -> fx.Node:
        name = f"crosscut_group_op{len(self.comms)}"
        self.comms.append(mod)
        self.root[name] = mod
        return self.graph.call_module(name, args)

    def output(self, n: fx.Node) -> None:
        """The stage outputs on the leader, and the final token last."""
        if self.member == 0:
            outs = fx.map_arg(n.args[0], lambda u: self.env[u])
            self.graph.output((*outs, self.token))  # type: ignore[misc]
        else:
            self.graph.output((self.token,))

    def gather(self, n: fx.Node, width: int) -> None:
        """An ``all_gather``: the leader receives each member's shard and concatenates."""
        graph, env, member, link = self.graph, self.env, self.member, self.link
        dim = int(n.args[0])  # type: ignore[arg-type]
        shards = list(n.args[2:])
        received = []
        for i in range(1, width):
            val = _val(shards[i])
            if member == 0:
                r = self.comm(
                    RecvOp(link, self.op, i, n.name, val.is_floating_point(), val.shape, val.dtype),
                    self.token,
                )
                self.token = graph.call_function(operator.getitem, (r, 0))
                received.append(graph.call_function(operator.getitem, (r, 1)))
            elif member == i:
                spec = SendOp(link, self.op, 0, n.name, val.is_floating_point())
                self.token = self.comm(spec, self.token, env[shards[i]])  # type: ignore[index]
            self.op += 1
        if member == 0:
            env[n] = graph.call_function(torch.cat, ([env[shards[0]], *received], dim))  # type: ignore[index]

    def broadcast(self, n: fx.Node, to: int, grad_free: set[str]) -> None:
        """A ``broadcast`` to member ``to``: a send on the leader, a receive on ``to``."""
        src = n.args[0]
        assert isinstance(src, fx.Node)
        val = _val(src)
        grad = val.is_floating_point() and src.name not in grad_free
        if self.member == 0:
            self.token = self.comm(
                SendOp(self.link, self.op, to, src.name, grad), self.token, self.env[src]
            )
        elif self.member == to:
            r = self.comm(
                RecvOp(self.link, self.op, 0, src.name, grad, val.shape, val.dtype), self.token
            )
            self.token = self.graph.call_function(operator.getitem, (r, 0))
            self.env[n] = self.graph.call_function(operator.getitem, (r, 1))
        self.op += 1

    def copy(self, gm: fx.GraphModule, n: fx.Node) -> None:
        """A node this member runs, with the module or attribute it reads."""
        if n.op == "call_module":
            self.root[str(n.target)] = gm.get_submodule(str(n.target))
        elif n.op == "get_attr":
            self.root[str(n.target)] = get_attr(gm, str(n.target))
        self.env[n] = self.graph.node_copy(n, lambda u: self.env[u])


@dataclass(frozen=True)
class _Input:
    kind: str  # "split" (batch-major tensors) | "whole" (tensors copied whole) | "const"
    value: Any  # the traced value (shapes and constants)
    grad: bool  # gradients travel back


class BatchMember(nn.Module):
    """Member ``member`` of a batch-split stage: the stage replicated, run on its share.

    ``inputs`` are the stage's traced input values (fake tensors or
    constants) in argument order, ``outputs`` its traced outputs; both fix
    every message's shape. Members past the batch size (a micro-batch smaller
    than the group) run nothing, as in the local runtime.
    """

    def __init__(
        self,
        inner: nn.Module,
        member: int,
        width: int,
        link: GroupLink,
        inputs: Sequence[tuple[str, Any]],
        outputs: Sequence[tuple[str, Any]],
        grad_free: set[str],
        mutated: set[int],
    ) -> None:
        super().__init__()
        self.inner = inner
        self.member, self.link, self.mutated = member, link, set(mutated)
        # the one rule both runtimes cut and join batch shares by (runtime/batch_shares.py)
        where = f"batch-split stage {link.stage}"
        batch = batch_of([v for _, v in inputs], where)
        self.bounds = share_bounds(batch, width)
        self.width = len(self.bounds)
        self.inputs: list[_Input] = []
        for name, v in inputs:
            floating = any(
                isinstance(t, torch.Tensor) and t.is_floating_point() for t in pytree.tree_leaves(v)
            )
            kind = input_kind(v, batch)
            self.inputs.append(
                _Input(kind, v, kind != "const" and floating and name not in grad_free)
            )
        self.names = [name for name, _ in inputs]
        self.outputs = []
        for name, v in outputs:
            check_output(v, batch, repr(name), where)
            self.outputs.append((name, v))
        self._ops = self._number_ops()
        link.ops = self._ops[1]

    def _number_ops(self) -> tuple[dict[tuple[str, int, int, int], int], int]:
        """Op index of every message, the same on every member: (kind, slot, leaf, member)."""
        ops: dict[tuple[str, int, int, int], int] = {}
        for j, spec in enumerate(self.inputs):
            leaves = [
                leaf
                for leaf, t in enumerate(pytree.tree_leaves(spec.value))
                if isinstance(t, torch.Tensor)
            ]
            for leaf in leaves if spec.kind != "const" else []:
                for i in range(1, self.width):
                    ops[("in", j, leaf, i)] = len(ops)
        for j, (_, v) in enumerate(self.outputs):  # a tensor, or a pytree of them: per leaf
            for leaf in range(len(pytree.tree_leaves(v))):
                for i in range(1, self.width):
                    ops[("out", j, leaf, i)] = len(ops)
        return ops, len(ops)

    def forward(self, *args: Any) -> tuple[Any, ...]:
        token: torch.Tensor = args[-1]
        if self.member == 0:
            return self._lead(list(args[:-1]), token)
        if self.member >= self.width:
            return (token,)
        return self._follow(token)

    def _lead(self, args: list[Any], token: torch.Tensor) -> tuple[Any, ...]:
        mine: list[Any] = []
        for j, (spec, a) in enumerate(zip(self.inputs, args)):
            if spec.kind == "split":  # every tensor in it cut by rows (batch_shares.split_rows)
                leaves, tree = pytree.tree_flatten(a)
                for leaf, t in enumerate(leaves):
                    if isinstance(t, torch.Tensor):
                        for i in range(1, self.width):
                            lo, hi = self.bounds[i]
                            token = self._op(
                                token, ("in", j, leaf, i), spec, t.narrow(0, lo, hi - lo)
                            )
                lo, hi = self.bounds[0]
                share = [
                    t.narrow(0, lo, hi - lo) if isinstance(t, torch.Tensor) else t for t in leaves
                ]
                if j in self.mutated:
                    share = [t.clone() if isinstance(t, torch.Tensor) else t for t in share]
                mine.append(pytree.tree_unflatten(share, tree))
                continue
            if spec.kind == "whole":
                for leaf, t in enumerate(pytree.tree_leaves(a)):
                    if isinstance(t, torch.Tensor):
                        for i in range(1, self.width):
                            token = self._op(token, ("in", j, leaf, i), spec, t)
            mine.append(a)
        outs = self.inner(*mine)
        merged: list[Any] = []
        for j, (name, v) in enumerate(self.outputs):
            mine_leaves, tree = pytree.tree_flatten(outs[j])
            joined = []
            for leaf, t in enumerate(pytree.tree_leaves(v)):
                parts = [mine_leaves[leaf]]
                for i in range(1, self.width):
                    lo, hi = self.bounds[i]
                    op = self._ops[0][("out", j, leaf, i)]
                    shape = (hi - lo, *tuple(t.shape[1:]))
                    token, part = recv(
                        token, self.link, op, i, name, t.is_floating_point(), shape, t.dtype
                    )
                    parts.append(part)
                joined.append(torch.cat(parts, 0) if len(parts) > 1 else parts[0])
            merged.append(pytree.tree_unflatten(joined, tree))
        return (*merged, token)

    def _op(
        self, token: torch.Tensor, key: tuple[str, int, int, int], spec: _Input, x: torch.Tensor
    ) -> torch.Tensor:
        grad = spec.grad and x.is_floating_point()
        name = self.names[key[1]]
        return send(token, x, self.link, self._ops[0][key], key[3], name, grad)

    def _follow(self, token: torch.Tensor) -> tuple[Any, ...]:
        k = self.member
        lo, hi = self.bounds[k]
        mine: list[Any] = []
        for j, spec in enumerate(self.inputs):
            name = self.names[j]
            if spec.kind == "const":
                mine.append(spec.value)
                continue
            leaves, tree = pytree.tree_flatten(spec.value)
            built = []
            for leaf, t in enumerate(leaves):
                if isinstance(t, torch.Tensor):
                    op = self._ops[0][("in", j, leaf, k)]
                    grad = spec.grad and t.is_floating_point()
                    # a split input's tensors arrive as this member's rows, a whole one's whole
                    shape = (hi - lo, *t.shape[1:]) if spec.kind == "split" else tuple(t.shape)
                    token, x = recv(token, self.link, op, 0, name, grad, shape, t.dtype)
                    built.append(x)
                else:
                    built.append(t)
            mine.append(pytree.tree_unflatten(built, tree))
        outs = self.inner(*mine)
        for j, (name, v) in enumerate(self.outputs):
            for leaf, (t, mine_t) in enumerate(
                zip(pytree.tree_leaves(v), pytree.tree_leaves(outs[j]))
            ):
                op = self._ops[0][("out", j, leaf, k)]
                token = send(token, mine_t, self.link, op, 0, name, t.is_floating_point())
        return (token,)
