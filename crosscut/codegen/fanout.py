"""Fan-out across a cut: one alias per reader, so gradients add up in eager's order.

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

Only values that need it are rewritten: three or more readers (two gradients
add the same either way) on two or more stages, unless the pipeline's order
is already eager's (one other stage whose readers come last in program
order, the usual contiguous cut). Values read in place (an
alias would change how autograd sees the mutation) and stages split across a
device group (whose rewrite knows its own ops) are left as they are. The
price: a remote reader's alias is its own transfer, so a stage with two
readers of ``v`` receives ``v`` twice.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import fx

__all__ = ["separate_fanout"]

_SKIP_OPS = ("placeholder", "get_attr", "output")


def _sums_like_eager(home: int, reader_stages: list[int]) -> bool:
    """Whether the pipeline already adds the readers' gradients in eager's order.

    It does when the readers sit on the value's own stage and at most one
    other, and that other stage's readers come last in program order: its
    subtotal is eager's first partial sum, and the local readers follow in
    eager's order.
    """
    remote = [i for i, s in enumerate(reader_stages) if s != home]
    if not remote:
        return True
    if len({reader_stages[i] for i in remote}) > 1:
        return False
    return remote == list(range(len(reader_stages) - len(remote), len(reader_stages)))


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
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutated = {n.args[0] for n in mutators if n.args and isinstance(n.args[0], fx.Node)}
    added: dict[str, str] = {}
    for v in list(gm.graph.nodes):
        home = stage_of.get(v.name)
        if v.op in _SKIP_OPS or home is None or v in mutated:
            continue  # model inputs: every stage reads its own copy already
        readers = sorted((u for u in v.users if u.op != "output"), key=order.__getitem__)
        if len(readers) < 3 or any(u in mutators or u in mutated for u in readers):
            continue
        stages = {home, *(stage_of[u.name] for u in readers)}
        if _sums_like_eager(home, [stage_of[u.name] for u in readers]) or stages & set(grouped):
            continue
        anchor = v
        for u in readers:  # in program order, right after v: older than every reader
            with gm.graph.inserting_after(anchor):
                alias = gm.graph.call_method("view_as", (v, v))
            alias.meta = dict(v.meta)
            stage_of[alias.name] = home
            u.replace_input_with(v, alias)
            added[alias.name] = v.name
            anchor = alias
    if added:
        gm.graph.lint()
        gm.recompile()
    return added
