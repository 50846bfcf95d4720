"""Activation recomputation of a stage: keep its inputs, recompute the rest in backward.

A stage that recomputes runs its forward under ``torch.utils.checkpoint``
(non-reentrant): autograd keeps only the stage's inputs per micro-batch and
re-runs the forward when the backward reaches it, trading one more forward
for the activations (GPipe's and torchgpipe's ``checkpoint=`` modes). The
engine's ``run`` callable is wrapped (:func:`recomputing`), so both runtimes
recompute the same way.

Recomputation must not change a number, so the second forward replays the
first one's state:

* **random ops** draw the same masks: crosscut's seeded ops re-enter the
  first pass's draw key (:meth:`~crosscut.runtime.rng.RandomScope.replaying`);
  only when no draw scope is active (ops draw from the caller's generator,
  one thread) does checkpoint save and restore that generator
  (``preserve_rng_state``); a leaf's draws from Python's ``random`` or NumPy
  get the first pass's values back (runtime/python_draws.py);
* **state** (every buffer the forward writes: batch norm's running statistics
  and counter, leaf or traced through, counters, EMAs) is read as the first
  pass read it and written only once: the recomputation runs against copies
  of the values it had before the first pass (runtime/state_replay.py).

Only a forward that may be backpropagated recomputes (grad mode: a
``train_step``, or a local differentiable ``forward``); inference under
``no_grad`` runs the stage as is.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

from crosscut.errors import InputError
from crosscut.ir.program import Stage
from crosscut.runtime import python_draws
from crosscut.runtime.batch_split import BatchSplitStage
from crosscut.runtime.rng import RandomScope
from crosscut.runtime.state_replay import Snapshot, StateReplay

__all__ = ["recompute_flags", "recomputing", "written_inputs"]

RunStage = Callable[[list[Any], int, bool], tuple[Sequence[Any], torch.Tensor | None]]


@contextmanager
def _sequential(stages: list[BatchSplitStage]) -> Iterator[None]:
    """Batch-split stages run their shares in share order on this thread."""
    saved = [st.parallel for st in stages]
    for st in stages:
        st.parallel = False
    try:
        yield
    finally:
        for st, flag in zip(stages, saved):
            st.parallel = flag


class _EachTime:
    """A context entered afresh each time: a retained graph's second backward recomputes again
    (checkpoint enters the one object ``context_fn`` gave it once per recomputation)."""

    def __init__(self, make: Callable[[], ExitStack]) -> None:
        self.make = make
        self.stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        self.stacks.append(self.make())

    def __exit__(self, *exc: object) -> None:
        self.stacks.pop().close()


def written_inputs(stage: Stage) -> list[int]:
    """Positions of the inputs ``stage`` writes in place (``Stage.mutated_inputs``)."""
    return [i for i, (name, _) in enumerate(stage.inputs) if name in stage.mutated_inputs]


def _copies(xs: tuple[Any, ...], writes: Collection[int]) -> list[Any]:
    return [
        pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)
        if i in writes
        else x
        for i, x in enumerate(xs)
    ]


def recomputing(
    module: nn.Module, scope: Callable[[], RandomScope | None], writes: Collection[int] = ()
) -> RunStage:
    """A stage ``run`` callable that recomputes ``module``'s activations in backward.

    ``scope()``: the program's :class:`~crosscut.runtime.rng.RandomScope`, whose
    pre-hook on ``module`` gave the first pass its draw key. ``writes``: the
    positions of the inputs the stage writes in place (:func:`written_inputs`).
    Each pass writes a copy of those made inside it: checkpoint keeps the
    inputs it was given and recomputes from them, so a first pass writing them
    would hand the recomputation changed values (and an input whose version
    moved since autograd saved it, which backward refuses: "modified by an
    inplace operation", seen with stochastic depth's ``x += shortcut`` on a
    received value).
    """

    # checkpoint matches the tensors a recomputation saves to the first pass's by order, so
    # a batch-split stage runs its shares one after another in both (bit-identical to the
    # threads: runtime/batch_split.py), and to the end (an early stop raises in the forward)
    shares = [sub for sub in module.modules() if isinstance(sub, BatchSplitStage)]
    state = StateReplay(module)

    def run(ins: list[Any], m: int, training: bool) -> tuple[Sequence[Any], torch.Tensor | None]:
        if not torch.is_grad_enabled():  # nothing will be backpropagated
            return list(module(*ins)), None
        key: list[tuple[int, int] | None] = [None]
        snap: list[Snapshot] = [{}]
        draws: list[Any] = []  # Python's and NumPy's draws of the first pass

        @contextmanager
        def first_pass() -> Iterator[None]:
            versions, before = state.before()
            with _sequential(shares), python_draws.recording(draws):
                yield
            snap[0] = state.after(versions, before)
            rng = scope()
            key[0] = rng.last_key(module) if rng is not None else None

        def recompute() -> ExitStack:
            with ExitStack() as stack:  # closed again if one of them fails to enter
                stack.enter_context(RandomScope.replaying(key[0]))
                stack.enter_context(state.replaying(snap[0]))
                stack.enter_context(_sequential(shares))
                stack.enter_context(python_draws.replaying(draws))
                return stack.pop_all()

        def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[Any]]:
            return first_pass(), _EachTime(recompute)

        # With a draw scope every random op of the stage draws from its own seeded key,
        # which the replay restores; saving and restoring the process-wide generator as
        # well would be wrong, not merely redundant: another stage's thread may be
        # drawing from it under runtime/rng.py's lock at that moment, and setting it
        # mid-draw changed that thread's dropout mask (seen under load).
        rng = scope()
        eager_draws = rng is None or rng.seed is None
        outs = checkpoint(
            lambda *xs: tuple(module(*_copies(xs, writes))),
            *ins,
            use_reentrant=False,
            context_fn=contexts,
            preserve_rng_state=eager_draws,
            early_stop=not shares,
        )
        return list(outs), None

    return run


def recompute_flags(recompute: bool | Sequence[bool], stages: int, bn_mode: str) -> list[bool]:
    """One flag per stage from ``recompute`` (one bool for all, or one per stage), checked.

    Refused with ``bn_mode`` ``"step"``/``"exact"``: those modes record each
    forward's batch statistics, and a recomputed forward would record twice.
    """
    flags = [bool(recompute)] * stages if isinstance(recompute, bool) else list(recompute)
    if len(flags) != stages or not all(isinstance(f, bool) for f in flags):
        raise InputError(
            "recompute must be one bool, or one bool per stage",
            value={"recompute": list(flags), "stages": stages},
            remedy=f"pass True/False or a list of {stages} bools",
        )
    if any(flags) and bn_mode != "micro":
        raise InputError(
            f"recompute cannot be combined with bn_mode={bn_mode!r}: a recomputed forward "
            "would record its batch statistics twice",
            value=bn_mode,
            remedy='use bn_mode="micro" with recompute, or recompute=False',
        )
    return flags
