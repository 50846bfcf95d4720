"""Fan-out across a cut: one alias per read, so gradients add up in eager's order.

A value read by several ops collects one gradient from each reader, and
autograd adds them in the order the readers' backward nodes run: the reverse
of the order the readers were created in, ``((g4 + g3) + g2) + g1`` for
readers ``c1..c4``. Floating-point addition is not associative, so the bits
depend on that order. Once a cut separates the readers, the pipeline changes
it: a later stage sums its own readers' gradients into the value's leaf, sends
that subtotal back, and the producing stage adds the subtotal FIRST (a root
gradient) and its local readers after — ``((g3 + g1) + g4) + g2`` for readers
1 and 3 on the later stage (googlenet cut inside an inception block: training
drifts from eager after a few steps).

The rewrite restores eager's order without touching the executors: right
after the value ``v`` is made, its stage creates one alias per reader,
``v.view_as(v)`` (no copy), in the readers' program order, and each reader
reads its own alias. A later stage then receives one leaf per remote reader
and returns each reader's gradient alone; in the producing stage every
alias's backward node runs after every reader's (aliases are older, and the
engine runs the newest ready node first), newest alias first, so ``v``'s
gradient accumulates as ``((g4 + g3) + g2) + g1`` — eager's sum, bit for bit.

A reader that reads the value twice (``torch.cat([v, v])``, ``v * v``) sends two
gradients, which its backward adds into ``v`` in argument order. Each read
counts (``frontend.readers.read_slots``) and gets its own alias; a reader's own
aliases are made in reverse argument order, so the newest-first engine adds
them in argument order, as eager does. Counted as one reader, a value read twice
by a ``cat`` and once by a pool on another stage trained 1 ulp off eager.

Only values that need it are rewritten: three or more reads (two gradients
add the same either way) on two or more stages, unless the pipeline's order
is already eager's (one other stage whose readers come last in program
order, the usual contiguous cut). Readers are autograd's: an op that returns
its input itself (``nn.Identity``) is looked through to its own readers, and an
op whose value holds no tensor (``x.shape``) is no reader. Values written in
place, directly or through an op that returned them (an alias made before the
write would read around it: a write into a ``clone`` would land in the value
itself), and stages split across a device group (whose rewrite knows its own
ops) are left as they are, and so are values that are not tensors (a
``torch.Size``, a tuple of shapes: they carry no gradient, and ``view_as`` does
not exist on them). The price: a remote reader's alias is its own transfer, so
a stage with two readers of ``v`` receives ``v`` twice. The half of the rule
that needs no cut (which values, which readers) is ``frontend/readers.py``,
the order test ``ir/problem.sums_like_eager``: the cost model reads both
(``PartitionProblem.fanout``, ``partitioner/fanout_cost.py``) and prices
that second transfer.

A parameter or buffer (a ``get_attr`` node) read on several stages is the
same case in another guise: the plan puts its node on one stage and prices an
edge to each remote reader, but ``split_module`` would copy the tensor into
every stage that reads it, and one tensor cannot live on two stages (a
parameter's two gradients and updates; a stage's ``.to(device)`` moving it
from under another). ``share_state_reads`` gives each of its readers an alias
on the node's stage instead, so the tensor lives there, remote readers receive
it as a value (and send a parameter's gradient back), and the aliases add the
readers' gradients in eager's order. State written in forward is not sent: a
copy would take the write (functional batch norm's running statistics move no
version counter, so ``state_writes`` reads them from the call).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import Any

import torch
from torch import fx

from crosscut.codegen.state_writes import state_writes
from crosscut.frontend.alias import own_value
from crosscut.frontend.readers import fanout_candidates, read_slots
from crosscut.ir.problem import sums_like_eager

__all__ = ["separate_fanout", "share_state_reads"]


def alias_of(v: Any) -> Any:
    """``v.view_as(v)`` for a tensor (a new autograd node, no copy); anything else as it is."""
    return v.view_as(v) if isinstance(v, torch.Tensor) else v


def _alias_readers(
    gm: fx.GraphModule,
    v: fx.Node,
    reads: list[tuple[fx.Node, fx.Node]],
    home: int,
    stage_of: dict[str, int],
) -> dict[str, str]:
    """One alias of ``v`` per ``(reader, node it reads)`` read, right after ``v``.

    Readers in program order; a reader's own reads (``torch.cat([v, v])``) in
    reverse argument order, since its backward adds its gradients into ``v`` in
    argument order and the newest alias's backward runs first."""
    added: dict[str, str] = {}
    anchor = v
    groups: dict[fx.Node, list[fx.Node]] = {}
    for u, p in reads:
        groups.setdefault(u, []).append(p)
    for u, ps in groups.items():  # in program order, right after v: older than every reader
        slots = sorted({i for p in set(ps) for i in read_slots(u, p)}, reverse=True)
        if len(slots) != len(ps):  # reads listed otherwise: one alias for them all
            slots = [-1]
        for slot in slots:
            with gm.graph.inserting_after(anchor):
                alias = gm.graph.call_function(alias_of, (v,))
            alias.meta = (
                {**v.meta, "val": own_value(v.meta["val"])} if "val" in v.meta else dict(v.meta)
            )
            stage_of[alias.name] = home
            _read_alias(u, set(ps), alias, slot)  # p is v, or an op that returned v itself
            added[alias.name] = v.name
            anchor = alias
    return added


def _read_alias(u: fx.Node, ps: set[fx.Node], alias: fx.Node, slot: int) -> None:
    """Make ``u`` read ``alias`` at its ``slot``-th node read (``frontend.readers.read_slots``),
    or wherever it reads one of ``ps`` when ``slot`` is -1."""
    seen = itertools.count()

    def swap(a: fx.Node) -> fx.Node:
        at = next(seen)
        return alias if a in ps and slot in (-1, at) else a

    u.args, u.kwargs = fx.node.map_arg((u.args, u.kwargs), swap)


def _fetch(gm: fx.GraphModule, v: fx.Node) -> Any:
    obj: Any = gm
    for part in str(v.target).split("."):
        obj = getattr(obj, part)
    return obj


def share_state_reads(
    gm: fx.GraphModule, stage_of: dict[str, int], mutators: Collection[fx.Node]
) -> dict[str, str]:
    """Give each reader of a parameter or buffer read on several stages its own alias.

    The alias sits on the ``get_attr`` node's stage in ``stage_of`` (or, for a
    hand-made assignment without it, the first reader's), so the tensor has one
    home; returns alias -> state node. State written in forward is left alone:
    by name or by version counter (``mutators``, the trace's records) or by a
    functional batch norm (``state_writes``); a copy sent as a value would take
    the write instead of the state, and the trace's mutation ties keep such
    state's readers on one stage.
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutated = {n.args[0] for n in mutators if n.args and isinstance(n.args[0], fx.Node)}
    written = {key for _, key in state_writes(gm)}
    added: dict[str, str] = {}
    for v in list(gm.graph.nodes):
        if v.op != "get_attr" or v in mutated or str(v.target) in written:
            continue
        if not isinstance(_fetch(gm, v), torch.Tensor):
            continue
        readers = sorted((u for u in v.users if u.op != "output"), key=order.__getitem__)
        stages = {stage_of[u.name] for u in readers if u.name in stage_of}
        if len(stages) < 2 or any(u in mutators for u in readers):
            continue
        home = stage_of.get(v.name, stage_of[readers[0].name])
        reads = [(u, v) for u in readers for _ in read_slots(u, v)]
        added |= _alias_readers(gm, v, reads, home, stage_of)
    if added:
        gm.graph.lint()
        gm.recompile()
    return added


def separate_fanout(
    gm: fx.GraphModule,
    stage_of: dict[str, int],
    mutators: Collection[fx.Node],
    grouped: Collection[int] = (),
) -> dict[str, str]:
    """Give each reader of a fanned-out, cut value its own alias; returns alias -> value.

    ``stage_of`` gains the aliases (on the value's stage). ``mutators`` are the
    nodes that modify their first input in place: a value they modify, or
    whose reader's result they modify (a view written through), is left
    alone. ``grouped`` are stages split over a device group.
    """
    added: dict[str, str] = {}
    for v, reads in fanout_candidates(gm, mutators):  # the cut-free half of the rule
        home = stage_of.get(v.name)
        if home is None:
            continue
        readers = [stage_of[u.name] for u, _ in reads]
        if sums_like_eager(home, readers) or {home, *readers} & set(grouped):
            continue
        added |= _alias_readers(gm, v, reads, home, stage_of)
    if added:
        gm.graph.lint()
        gm.recompile()
    return added
