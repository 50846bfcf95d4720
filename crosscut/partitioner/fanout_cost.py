"""The transfers a pipeline cut makes, counted as codegen makes them: fan-out included.

A value crosses to each later stage that reads it once (``codegen/transfers.py``),
except where ``codegen/fanout.py`` gives every reader its own alias so that the
readers' gradients add in eager's order, bit for bit: then a remote reader's
alias is its own transfer, and a stage with two readers of the value receives
it twice (each time with its bytes, its messages, its gradient and its receive
buffer). That rewrite applies to the values ``PartitionProblem.fanout`` lists
(``frontend/readers.py``: a tensor, not written in place, three or more autograd
readers) whenever the cut breaks eager's order (``ir/problem.sums_like_eager``,
the function codegen reads too). Pricing one transfer per stage there made
interleaved re-cuts of densenet121 look cheap: 41 transfers priced per
micro-batch at four stages per device, 170 sent.

This is the pipeline path of :func:`~crosscut.partitioner.evaluate.evaluate`
only: codegen leaves values on stages split over a device group alone, and the
cross-shaped model keeps one transfer per stage. The CP-SAT model and the
solvers' bounds do not model it either: they price one transfer per (value,
stage), which is never more than this count (the aliases replace the reads they
stand for), so their objective is a lower bound on the re-priced plan's, equal
to it where no fanned-out value's readers are cut out of eager's order.
"""

from __future__ import annotations

from collections.abc import Sequence

from crosscut.ir.problem import PartitionProblem, sums_like_eager

__all__ = ["cut_transfers", "rewired_reads"]


def rewired_reads(
    problem: PartitionProblem, stage_of: Sequence[int]
) -> tuple[set[tuple[int, int]], dict[int, list[int]]]:
    """The reads codegen moves to aliases under ``stage_of``, and each value's aliases.

    Returns the ``(node read, reader)`` edges no longer read from the node
    (the reader reads an alias of the value instead), and value -> the stage of
    each remote reader's alias, one entry per alias. Values are taken in
    program order, as codegen rewrites them: a value that another hands through
    (``nn.Identity``) keeps only the readers the earlier rewrite left it, and
    needs three of them still.
    """
    rewired: set[tuple[int, int]] = set()
    aliases: dict[int, list[int]] = {}
    for v in sorted(problem.fanout):
        reads = [(r, p) for r, p in problem.fanout[v] if (p, r) not in rewired]
        home = stage_of[v]
        stages = [stage_of[r] for r, _ in reads]
        if len(reads) < 3 or sums_like_eager(home, stages):
            continue
        rewired |= {(p, r) for r, p in reads}
        aliases[v] = [k for k in stages if k != home]
    return rewired, aliases


def cut_transfers(
    problem: PartitionProblem, stage_of: Sequence[int], cons: Sequence[Sequence[int]]
) -> list[tuple[int, int, int]]:
    """``(value, from stage, to stage)`` per transfer, by value then destination stage.

    ``cons[u]``: ``u``'s consumers (``evaluate.consumers``). One per value and
    later stage that reads it, and one per remote reader of a value the fan-out
    rewrite gives aliases (:func:`rewired_reads`): the same (value, stage) pair
    then appears once per transfer.
    """
    rewired, aliases = rewired_reads(problem, stage_of) if problem.fanout else (set(), {})
    out: list[tuple[int, int, int]] = []
    for u, cs in enumerate(cons):
        j = stage_of[u]
        stages = {stage_of[c] for c in cs if (u, c) not in rewired} - {j}
        out += [(u, j, k) for k in sorted([*stages, *aliases.get(u, [])])]
    return out
