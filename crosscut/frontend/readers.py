"""Which traced values a cut may give one alias per reader: autograd's readers of a value.

``codegen/fanout.separate_fanout`` rewrites a value read by three or more ops
into one alias per reader once a cut separates the readers (its docstring says
why: gradients then add in eager's order, bit for bit). Whether the rewrite CAN
apply to a value does not depend on the cut: a tensor, not written in place,
with three or more autograd readers. The rule lives here, below codegen and the
partitioner, so that the code generator applies it and the cost model
(``partitioner/build.fanout_reads`` → ``PartitionProblem.fanout``) prices it
from the same function; the stage-dependent half (which cuts keep eager's order
already) is ``ir/problem.sums_like_eager``.

Readers are autograd's: an op that returns its input itself (``nn.Identity``)
is looked through to its own readers, and an op whose value holds no tensor
(``x.shape``) is no reader.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from crosscut.frontend.alias import inplace_target, mutated_value

__all__ = [
    "SKIP_OPS",
    "autograd_readers",
    "fanout_candidates",
    "fanout_reads",
    "inplace_mutators",
    "is_tensor_value",
    "read_slots",
]

SKIP_OPS = ("placeholder", "get_attr", "output")


def is_tensor_value(v: fx.Node) -> bool:
    """Whether ``v`` makes a tensor, by the trace's record; a node without one counts as one.

    Graphs made by a bare ``fx.symbolic_trace`` carry no values; there the alias
    (``codegen/fanout.alias_of``) checks at run time instead.
    """
    for key in ("val", "example_value", "tensor_meta"):
        if key in v.meta:
            val = v.meta[key]
            return isinstance(val, torch.Tensor) or type(val).__name__ == "TensorMetadata"
    return True


def _passes_through(gm: fx.GraphModule, u: fx.Node, p: fx.Node) -> bool:
    """Whether ``u`` returns its input ``p`` itself: no autograd node, so not a reader.

    By the trace's fake values (``nn.Identity``, ``contiguous()`` of a contiguous
    tensor, dropout with ``p=0``: the op hands back the very object; nodes made
    after the trace that copy get a value of their own, ``alias.own_value``),
    or, on a graph without them, by ``nn.Identity``. In-place ops also return
    their input; :func:`autograd_readers` stops at them first.
    """
    if "val" in u.meta and "val" in p.meta:
        return u.meta["val"] is p.meta["val"]
    return u.op == "call_module" and isinstance(gm.get_submodule(str(u.target)), nn.Identity)


def _holds_tensor(u: fx.Node) -> bool:
    """Whether ``u``'s value holds a tensor (a node without a recorded value counts as one).

    An op that makes only a ``torch.Size``, an int or a bool (``x.shape``,
    ``x.size(0)``, ``x.dim()``) sends no gradient back: it is no reader for the
    gradient's order, and needs no alias of its own.
    """
    if "val" not in u.meta:
        return True
    leaves, _ = tree_flatten(u.meta["val"])
    return any(isinstance(t, torch.Tensor) for t in leaves)


def autograd_readers(
    gm: fx.GraphModule, v: fx.Node, writes: Collection[fx.Node], written: Collection[fx.Node]
) -> list[tuple[fx.Node, fx.Node]] | None:
    """``(reader, node it reads)`` for each read whose backward adds into ``v``'s gradient
    (a reader that reads ``v`` twice appears twice: :func:`read_slots`), as found;
    :func:`fanout_candidates` puts them in program order.

    Ops that return ``v`` itself are looked through: eager's gradient for ``v``
    comes from THEIR readers, at those readers' places in program order (dla's
    ``nn.Identity`` downsample read after a sibling convolution). ``None`` when
    ``v`` is written in place on the way: a reader that writes (``writes``: an
    in-place op also returns its input itself, but a reader rewired past it
    would read ``v`` around the write), whose result is written (``written``),
    or that orders a read after a write (``mutated_value``): such values are
    left alone.
    """
    out: list[tuple[fx.Node, fx.Node]] = []
    todo = [v]
    while todo:
        p = todo.pop()
        for u in p.users:
            if u.op == "output":
                continue
            if u in writes or u in written or u.target is mutated_value:
                return None
            if _passes_through(gm, u, p):
                todo.append(u)
            elif _holds_tensor(u):
                out += [(u, p)] * len(read_slots(u, p))
    return out


def read_slots(u: fx.Node, p: fx.Node) -> list[int]:
    """Where ``u`` reads ``p``: the indices, among every node ``u`` reads (args, then
    kwargs, as ``fx.node.map_arg`` visits them), that are ``p``.

    Each is a gradient of its own: ``torch.cat([v, v])`` or ``v * v`` sends two
    into ``v``, added in argument order. A value read twice by one op and once by
    another collects three (a fuzzed model whose ``cat`` read a value twice and a
    pool once, cut apart, trained 1 ulp off eager when they counted as two)."""
    nodes: list[fx.Node] = []
    fx.node.map_arg((u.args, u.kwargs), nodes.append)
    return [i for i, a in enumerate(nodes) if a is p]


def inplace_mutators(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that modify their first input in place, by name or flag (``add_``)."""
    modules = dict(gm.named_modules())
    return [n for n in gm.graph.nodes if n.op not in SKIP_OPS and inplace_target(n, modules)]


def fanout_candidates(
    gm: fx.GraphModule, mutators: Collection[fx.Node]
) -> Iterator[tuple[fx.Node, list[tuple[fx.Node, fx.Node]]]]:
    """Every value the fan-out rewrite may apply to, whatever the cut, and its reads.

    A tensor made by an op (not an input or a parameter: every stage reads
    those its own way), not written in place (``mutators`` modify their first
    input), with three or more autograd readers (two gradients add the same
    either way); its ``(reader, node it reads)`` pairs in program order, the
    order the rewrite makes the aliases in. Lazy, over the nodes as they were
    when it started: a caller that rewires one value's readers (to aliases)
    before asking for the next sees the next one's readers as they are then.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutated = {n.args[0] for n in mutators if n.args and isinstance(n.args[0], fx.Node)}
    for v in list(gm.graph.nodes):
        if v.op in SKIP_OPS or v in mutated or not is_tensor_value(v):
            continue
        found = autograd_readers(gm, v, mutators, mutated)
        if found is not None and len(found) >= 3:
            yield v, sorted(found, key=lambda r: order[r[0]])


def fanout_reads(gm: fx.GraphModule) -> dict[str, list[tuple[str, str]]]:
    """:func:`fanout_candidates` of a traced module, by node name: what the cost model
    needs to price the rewrite (one transfer per remote reader) before any cut exists.

    The in-place writers are the traced graph's own. Codegen finds them again on
    its copy after ``split._protect_inplace`` has given a write read across a
    cut a clone of its own, which may free a value written in place for the
    rewrite; such a value is not counted here (its write ties most readers to
    one stage anyway).
    """
    found = fanout_candidates(gm, inplace_mutators(gm))
    return {v.name: [(u.name, p.name) for u, p in reads] for v, reads in found}
