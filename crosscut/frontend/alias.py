"""Alias analysis: which traced values share storage, and which nodes write into it.

Why a pipeline needs it. Eager PyTorch runs a forward in program order, so a
write into a slice (``y[:, :4].add_(1)``, ``y.narrow(1, 4, 2).mul_(2)``,
``w[:, 0].relu_()``) is seen by every later reader of ``y``
and by none before it. The fx graph does not say so: the reader of ``y`` has an
edge to ``y``'s producer, not to the write into its view, so a plan may put the
reader on an earlier stage than the write (it then misses it) or a later one
while another micro-batch's write is already in flight (same-device stages
hand tensors over without copying). ``codegen/split.py``'s ``_protect_inplace``
repairs the simple case, an in-place op it recognises by name on the value it
receives directly. Everything else — writes through a view, ``setitem``,
functional writes it cannot name, and state (buffers) written in forward — is
made explicit graph structure here, BEFORE partitioning, so the solver sees it.

How aliases are found: by mechanism, not by a list of view ops. The trace runs
every node on fake tensors (``propagate.py``), and fake tensors keep PyTorch's
real view semantics: a view (``getitem`` with slices or ints, ``narrow``,
``view``, ``reshape``, ``select``, ``transpose``, ``permute``, ``expand``,
``unsqueeze``, ``squeeze``, ``flatten``, ``t``, ``as_strided``,
``chunk``/``split``/``unbind`` items, ``contiguous``/``to``/``type`` that
return ``self``, ``detach``, ``nn.Identity``, ``nn.Flatten``, an in-place op's
result, ...) shares its base's storage. Two nodes are in one *alias class* when
their outputs share a storage; the class's *base* is its first node in graph
order. A write is found the same way: every tensor a node reads has its version
counter recorded before and after the node runs (views share the counter with
their base), so ``out=`` arguments and writes without a trailing underscore
(``operator.setitem`` where a graph has it) are caught too;
:func:`inplace_target` (names: ``add_``, ``inplace=True``, ``+=``) covers
nodes the fake tensors could not run (leaves run on zeros).

What is done with a class that is written through a view (or by a write
``_protect_inplace`` cannot name, or whose base is model state or a model
input). From its first view or write on, a model input, or a computed base
that something reads before that point, is read through ``base.clone()``
(:func:`_write_a_copy`), which becomes the class's base: the early readers
see the value as made, on any stage. Let ``L`` be its last write in graph
order. The class's base, its members up to ``L``, and every node reading a
member before ``L`` become one tie
(``OpGraph.ties``, honoured by every solver, and checked again by codegen for
hand-made plans), so the writes happen in eager order on one stage. Each node
that reads a member ``X`` after ``L`` is rewired to read
``mutated_value(X, L)``, an identity whose second argument is ``L``: an edge
that puts it no earlier than the write and hands it the written value. These
identities join the tie, so what crosses a cut is the value after the last
write. Ties stay small: a class of plain in-place chains (``ReLU(inplace=True)``,
``out += identity``) without views is left to ``_protect_inplace`` (its later
readers only read the write's result, :func:`_read_after_plain_writes`, an
edge the solver sees), and so is a
chain whose every later step reads the previous write's result (timm's
``bn -> Identity -> ReLU(inplace=True)``, :func:`_is_chain`): data edges
already order it.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "GROUP",
    "MUTATED",
    "MUTATES",
    "STATE",
    "AliasClass",
    "alias_classes",
    "find_root",
    "functional_norm_writes",
    "inplace_target",
    "mutated_value",
    "order_mutations",
    "own_value",
    "record_writes",
    "versions",
    "written_state_ties",
]

MUTATED = "crosscut_mutated"  # meta: input nodes whose storage this node wrote (trace time)
STATE = "crosscut_state_writes"  # meta: a call_module's own state it wrote (qualified keys)
MUTATES = "crosscut_mutates"  # meta: names of the values (base and views) this node writes
GROUP = "crosscut_mutation_group"  # meta: index of the mutation tie this node belongs to

_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.iand,
    operator.ior,
    operator.ixor,
}


def mutated_value(x: Any, *after: Any) -> Any:
    """``x`` itself; the other arguments are writes it must follow (graph edges only)."""
    return x


def own_value(val: Any) -> Any:
    """A fake value like ``val`` but a new tensor, for a node made after the trace that copies.

    The trace's fake values keep run-time identity: a node whose value IS its
    input's object returns that very tensor (``nn.Identity``, ``contiguous()``
    of a contiguous tensor, an in-place op), and codegen/fanout.py reads it so.
    A node inserted later that makes a new tensor (``clone``, a ``view_as``
    alias) must not copy its input's value object, or it claims to hand its
    input through and a pass that looks through such ops skips the copy.
    """

    def fresh(t: Any) -> Any:
        if isinstance(t, FakeTensor):
            with t.fake_mode:
                return t.clone()
        return t.clone() if isinstance(t, Tensor) else t

    return tree_map(fresh, val)


def inplace_target(node: fx.Node, modules: Mapping[str, nn.Module]) -> fx.Node | None:
    """The input ``node`` modifies in place by its name or flag (``add_``, ``inplace=True``)."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None:
        return None
    if node.op == "call_module":
        return first if getattr(modules[str(node.target)], "inplace", False) is True else None
    if node.op == "call_method":
        t = str(node.target)
        return first if t.endswith("_") and not t.endswith("__") else None
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return first
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return first
        try:
            bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return first if node.kwargs.get("inplace") is True else None
        return first if bound.arguments.get("inplace") is True else None
    return None


# ---- recording writes while the trace runs each node on fake tensors ----------------


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


def versions(
    node: fx.Node, env: Mapping[fx.Node, Any], module: nn.Module | None
) -> dict[str, list[int]]:
    """Version counters of what ``node`` can write: its inputs, and a module's own buffers
    and parameters (a leaf that updates a mean teacher's weights in its forward)."""
    out = {a.name: [t._version for t in _tensors(env.get(a))] for a in node.all_input_nodes}
    if module is not None:
        for key, t in [*module.named_buffers(), *module.named_parameters()]:
            out[f"{node.target}.{key}"] = [t._version]
    return out


def record_writes(
    node: fx.Node, before: Mapping[str, list[int]], after: Mapping[str, list[int]]
) -> None:
    """Store in ``node.meta`` the inputs and module buffers whose version counters moved."""
    moved = [k for k, v in before.items() if after.get(k) != v]
    inputs = {a.name for a in node.all_input_nodes}
    node.meta[MUTATED] = [k for k in moved if k in inputs]
    node.meta[STATE] = [k for k in moved if k not in inputs]


# ---- alias classes ---------------------------------------------------------------------


@dataclass
class AliasClass:
    """Nodes whose outputs share one storage, and the nodes writing into it."""

    base: fx.Node
    members: list[fx.Node] = field(default_factory=list)  # graph order, base first
    writes: list[fx.Node] = field(default_factory=list)  # graph order


def _storages(node: fx.Node) -> list[Any]:
    refs = []
    for t in _tensors(node.meta.get("val")):
        try:
            refs.append(StorageWeakRef(t.untyped_storage()))  # type: ignore[no-untyped-call]
        except (RuntimeError, NotImplementedError):  # sparse / storage-less tensors
            continue
    return refs


_K = TypeVar("_K")


def find_root(parent: dict[_K, _K], x: _K) -> _K:
    """Union-find: the root of ``x``'s set in the forest ``parent`` (paths halved on the way)."""
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def alias_classes(gm: fx.GraphModule) -> list[AliasClass]:
    """The alias classes of ``gm`` (from the trace's fake values) that something writes."""
    parent: dict[Any, Any] = {}

    def find(x: Any) -> Any:
        return find_root(parent, x)

    node_ref: dict[fx.Node, Any] = {}
    for n in gm.graph.nodes:
        refs = _storages(n)
        for r in refs:
            parent.setdefault(r, r)
        for r in refs[1:]:
            parent[find(r)] = find(refs[0])
        if refs:
            node_ref[n] = refs[0]
    classes: dict[Any, AliasClass] = {}
    for n in gm.graph.nodes:
        if n in node_ref:
            root = find(node_ref[n])
            cls = classes.setdefault(root, AliasClass(n))
            cls.members.append(n)
    of = {n: find(r) for n, r in node_ref.items()}
    modules = dict(gm.named_modules())
    for n in gm.graph.nodes:
        if n.op not in ("call_module", "call_function", "call_method"):
            continue
        written = {a for a in n.all_input_nodes if a.name in n.meta.get(MUTATED, [])}
        static = inplace_target(n, modules)
        if n.target is operator.setitem and isinstance(n.args[0], fx.Node):
            static = n.args[0]  # y[idx] = v: a write _protect_inplace cannot rewire (None)
        if static is not None:
            written.add(static)
        for root in {of[a] for a in written if a in of}:
            classes[root].writes.append(n)
    return [c for c in classes.values() if c.writes]


# ---- making write order graph structure ------------------------------------------------


_META_METHODS = {"size", "dim", "stride", "numel", "nelement", "is_contiguous", "element_size"}


def _reads_data(u: fx.Node) -> bool:
    """False for ``x.shape`` / ``x.size()`` and the like: shapes do not change on a write."""
    if u.op == "call_function" and u.target is getattr:
        return False
    return not (u.op == "call_method" and u.target in _META_METHODS)


def _is_chain(cls: AliasClass, order: Mapping[fx.Node, int]) -> bool:
    """Nothing outside the class can see the writes out of order: no tie is needed.

    True when no node outside the class reads a value made before the last
    write (so no reader may run before a write, nor miss one), every write
    reads the previous write or a later value (so the writes are ordered by
    data edges), and every value made after the last write reads only it or
    later values (so each later reader depends on it by a data edge). timm's ``bn -> Identity
    -> ReLU(inplace=True)`` blocks are such chains; a stage that receives one
    of their values and writes it clones it (``Stage.mutated_inputs``).
    """
    last = order[cls.writes[-1]]
    inside = {*cls.members, *cls.writes}
    for prev, w in zip(cls.writes, cls.writes[1:]):
        # ``y[:, :4].mul_(2); y.relu_()``: the second write reads ``y`` as made, so no
        # edge puts it after the first, and a cut (or a channel split) between them
        # would let it run on the value without the first write
        if not any(a in inside and order[a] >= order[prev] for a in w.all_input_nodes):
            return False
    for m in cls.members:
        if order[m] < last and any(u not in inside and _reads_data(u) for u in m.users):
            return False
        if order[m] > last and any(order[a] < last for a in m.all_input_nodes if a in inside):
            return False
    return True


def _needs_order(cls: AliasClass, modules: Mapping[str, nn.Module]) -> bool:
    """A class ``_protect_inplace`` cannot handle: a view, an unnamed write, state, an input."""
    if cls.base.op in ("get_attr", "placeholder"):
        return True
    order = {n: i for i, n in enumerate(cls.base.graph.nodes)}
    if _is_chain(cls, order):
        return False
    last = order[cls.writes[-1]]
    writes = set(cls.writes)
    if any(m is not cls.base and m not in writes and order[m] < last for m in cls.members):
        return True  # a view exists while the class is written
    return any(inplace_target(w, modules) is None for w in cls.writes)


def order_mutations(gm: fx.GraphModule) -> list[list[str]]:
    """Make write order explicit in ``gm`` (in place); returns the ties to keep on one stage.

    See the module docstring. Nodes of each tie carry ``meta[GROUP]`` (its
    index) so codegen can refuse a hand-made plan that splits them, and each
    write carries ``meta[MUTATES]`` (the values of its class made up to it) so a
    stage knows which of its inputs it changes.
    """
    modules = dict(gm.named_modules())
    ties: list[list[str]] = []
    for cls in alias_classes(gm):
        handled = _needs_order(cls, modules)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # identities were inserted
        if handled and cls.base.op != "get_attr" and _copy_pays(cls, order):
            _write_a_copy(gm, cls, order)
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for w in cls.writes:  # every value of the class it changes (a stage input among
            # them is cloned before the stage writes it: split.py's mutated_inputs)
            seen = [m.name for m in cls.members if order[m] <= order[w]]
            w.meta[MUTATES] = sorted({*w.meta.get(MUTATES, []), cls.base.name, *seen})
        if not handled:
            continue
        last = cls.writes[-1]
        early = {m for m in cls.members if order[m] <= order[last]}  # values written by L
        readers = {u for m in early for u in m.users if _reads_data(u)}
        tie = {cls.base, *early, *cls.writes, *(u for u in readers if order[u] < order[last])}
        tie |= _rewire_later_readers(gm, early, readers, last, order)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        group = len(ties)
        names = []
        for n in sorted(tie, key=order.__getitem__):
            if n.op in ("placeholder", "output"):
                continue
            n.meta[GROUP] = group
            names.append(n.name)
        ties.append(names)
    _read_after_plain_writes(gm, modules)
    gm.graph.lint()
    gm.recompile()
    return [t for t in ties if len(t) > 1]


def _read_after_plain_writes(gm: fx.GraphModule, modules: Mapping[str, nn.Module]) -> None:
    """Readers of ``v`` after a plain in-place op ``w`` on ``v`` read ``w`` instead.

    ``w`` returns ``v`` itself, so nothing changes at run time; what changes is
    the graph the solver sees: an edge ``w -> u`` that keeps ``u`` no earlier
    than the write. Without it a plan could put ``u`` on an earlier stage than
    ``w`` (drop path's ``bernoulli_`` read after ``div_``), which codegen's
    ``_protect_inplace`` can only refuse — a constraint the solver did not know.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for w in list(gm.graph.nodes):
        v = inplace_target(w, modules) if w.op not in ("placeholder", "output") else None
        if v is None or v.op in ("placeholder", "get_attr") or GROUP in w.meta:
            continue  # a tie's writes are ordered by its own rewiring above
        for u in list(v.users):
            if u is not w and u.op != "output" and order[u] > order[w]:
                u.replace_input_with(v, w)


def _first_touch(cls: AliasClass, order: Mapping[fx.Node, int]) -> fx.Node:
    """The class's first view or write: before it, the base is read as it was made."""
    return min((m for m in [*cls.members, *cls.writes] if m is not cls.base), key=order.__getitem__)


def _copy_pays(cls: AliasClass, order: Mapping[fx.Node, int]) -> bool:
    """A model input always; a computed base when some node reads it before the first touch."""
    if cls.base.op == "placeholder":
        return True
    first = order[_first_touch(cls, order)]
    inside = {*cls.members, *cls.writes}
    return any(u not in inside and u.op != "output" and order[u] < first for u in cls.base.users)


def _write_a_copy(gm: fx.GraphModule, cls: AliasClass, order: Mapping[fx.Node, int]) -> None:
    """From the class's first view or write on, the base is read through ``base.clone()``.

    The writes then change the copy, and the base keeps the value it was made
    with, so its readers before that point stay out of the tie and may sit on
    any stage (they would otherwise all join it: cheap in bytes, one copy per
    micro-batch, against a tie that can span the network). For a model input
    it is needed anyway: micro-batches are views of the caller's batch sharing
    one version counter, so writing one would invalidate what autograd saved for
    another. The caller's tensor is left as it was (eager would write it);
    every value the model computes is eager's.
    """
    x = cls.base
    first = _first_touch(cls, order)
    with gm.graph.inserting_before(first):
        c = gm.graph.call_method("clone", (x,))
    c.meta = {k: v for k, v in x.meta.items() if k in ("val", "tensor_meta", "nn_module_stack")}
    if "val" in c.meta:
        c.meta["val"] = own_value(c.meta["val"])  # a copy, not ``x`` handed through
    for u in list(x.users):
        if u is not c and (u.op == "output" or order[u] >= order[first]):
            u.replace_input_with(x, c)
    cls.base = c
    cls.members = [c, *(m for m in cls.members if m is not x)]


def _rewire_later_readers(
    gm: fx.GraphModule,
    members: set[fx.Node],
    readers: set[fx.Node],
    last: fx.Node,
    order: Mapping[fx.Node, int],
) -> set[fx.Node]:
    """Readers after ``last`` read ``mutated_value(member, last)``; returns those identities.

    ``members`` are the class's values up to ``last``; views made after it are
    ordinary readers (nothing writes the class after them).
    """
    made: dict[fx.Node, fx.Node] = {}
    anchor = last
    for u in sorted(readers, key=order.__getitem__):
        if order[u] <= order[last]:
            continue
        for x in sorted((a for a in u.all_input_nodes if a in members), key=order.__getitem__):
            if x not in made:
                with gm.graph.inserting_after(anchor):
                    ident = gm.graph.call_function(mutated_value, (x, last))
                ident.meta = {k: v for k, v in x.meta.items() if k in ("val", "tensor_meta")}
                if "nn_module_stack" in last.meta:
                    ident.meta["nn_module_stack"] = last.meta["nn_module_stack"]
                made[x] = anchor = ident
            u.replace_input_with(x, made[x])
    return set(made.values())


# fn -> (running_mean, running_var, training flag: name, position, default)
_NORMS: dict[object, tuple[tuple[str, int], tuple[str, int], tuple[str, int, bool]]] = {
    F.batch_norm: (("running_mean", 1), ("running_var", 2), ("training", 5, False)),
    F.instance_norm: (("running_mean", 1), ("running_var", 2), ("use_input_stats", 5, True)),
    torch.batch_norm: (("running_mean", 3), ("running_var", 4), ("training", 5, False)),
}


def _arg(n: fx.Node, name: str, i: int, default: object = None) -> object:
    return n.kwargs.get(name, n.args[i] if len(n.args) > i else default)


def functional_norm_writes(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """``(node, key)``: a functional batch norm in training mode updating buffers it reads.

    Its kernel moves the running statistics without moving their version
    counters, so the trace's version check (``frontend/alias.py``) does not
    see the write; the call itself says it (``training=True``, or
    ``use_input_stats`` for ``F.instance_norm``).
    """
    out: list[tuple[str, str]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _NORMS:
            continue
        mean, var, flag = _NORMS[n.target]
        if _arg(n, *flag) is False:
            continue
        stats = [_arg(n, *mean), _arg(n, *var)]
        out += [
            (n.name, str(a.target)) for a in stats if isinstance(a, fx.Node) and a.op == "get_attr"
        ]
    return out


def written_state_ties(gm: fx.GraphModule) -> list[list[str]]:
    """The buffer node of every state a functional norm writes, with all its readers.

    A buffer forward writes cannot be sent to another stage as a value (a copy
    would take the write: ``codegen/fanout.share_state_reads``), and codegen
    refuses a tensor owned by two stages. Its readers therefore share the
    buffer's stage: a tie (``OpGraph.ties``) the solver honours, so a plan from
    ``partition`` compiles. What they compute from it crosses cuts as usual.
    Writes in place move a version counter and are tied by
    :func:`order_mutations`; a functional norm's kernel moves none.
    """
    keys = {key for _, key in functional_norm_writes(gm)}
    return [
        [n.name, *(u.name for u in n.users if u.op != "output")]
        for n in gm.graph.nodes
        if n.op == "get_attr" and str(n.target) in keys and len(n.users) > 1
    ]
