"""The stages one rank runs: its own, or ``V`` of an interleaved plan, with their messages.

Under every schedule but the interleaved ones a rank runs one stage. Under
``"1f1b-vV"`` (:mod:`crosscut.ir.interleaved`) rank ``r`` of a replica's ``W``
runs stages ``r, r + W, ..., r + (V - 1) W`` (under ``"zbv"``: ``r`` and
``2W - 1 - r``), in the one order of its schedule row. Each stage keeps its
own :class:`~crosscut.runtime.dist.stage_io.StageIO` (its edges and tags) and
:class:`~crosscut.runtime.engine.StageEngine` (its saved micro-batches),
exactly as a one-stage rank's; what is shared is the rank's module (a
``ModuleList`` of the stages, for state and the optimizer) and its
:class:`~crosscut.runtime.dist.p2p.Messenger`, which keeps a value sent
between two of the rank's own stages off the wire. Kept apart from
:mod:`~crosscut.runtime.dist.rank_executor` so that file reads like one rank's
step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from crosscut.errors import InputError
from crosscut.ir.program import StagedProgram
from crosscut.ir.schedule import Action, same_cut, virtual_stages
from crosscut.runtime.dist.stage_io import StageIO
from crosscut.runtime.engine import RunStage, StageEngine

__all__ = ["RankStages", "check_same_cut", "stages_module"]


def check_same_cut(schedule: str, plan_schedule: str) -> None:
    """A schedule a rank runs must need the plan's cut: as many stages per rank, placed
    alike (:func:`~crosscut.ir.schedule.same_cut`)."""
    if not same_cut(schedule, plan_schedule):
        raise InputError(
            f"schedule {schedule!r} runs {virtual_stages(schedule)} stage(s) per rank, but "
            f"the plan's {plan_schedule!r} was cut for {virtual_stages(plan_schedule)}"
            + (" placed in a V" if plan_schedule.lower() == "zbv" else ""),
            value=schedule,
            remedy="use the plan's own schedule, or re-partition for this one",
        )


def stages_module(
    program: StagedProgram, stages: Sequence[int]
) -> tuple[nn.Module, dict[str, list[str]]]:
    """The module holding ``stages`` and its tensors' original keys (local name -> keys).

    One stage: its own module and names. Several: a ``ModuleList`` whose child
    ``j`` is the ``j``-th of ``stages``, its names prefixed ``"j."``."""
    if len(stages) == 1:
        st = program.stages[stages[0]]
        return st.module, dict(st.param_keys)
    held = nn.ModuleList([program.stages[k].module for k in stages])
    keys = {
        f"{j}.{local}": original
        for j, k in enumerate(stages)
        for local, original in program.stages[k].param_keys.items()
    }
    return held, keys


class RankStages:
    """Per stage of this rank: its engine and its messages; one schedule row over them."""

    def __init__(self, ios: dict[int, StageIO], engines: dict[int, StageEngine]) -> None:
        self.ios = ios
        self.engines = engines

    @classmethod
    def build(
        cls,
        program: StagedProgram,
        io: StageIO,
        stages: Sequence[int],
        recompute: Sequence[bool],
        run_of: Callable[[int], RunStage],
        replay_of: Callable[[int], RunStage],
    ) -> RankStages:
        """``io`` copied for each of ``stages`` (its own buffers), and one engine each: run
        by ``run_of(k)``, or by ``replay_of(k)`` where stage ``k`` recomputes."""
        ios = {k: dataclasses.replace(io, stage=k, dtypes={}, posted={}) for k in stages}
        engines = {
            k: StageEngine.for_stage(
                program, k, io.microbatches, run=replay_of(k) if recompute[k] else run_of(k)
            )
            for k in stages
        }
        return cls(ios, engines)

    def start(self, row: Sequence[Action]) -> Iterator[Action]:
        """Yield ``row``'s actions, each with its own and the next action's receives posted
        (:meth:`StageIO.start`, with each action posted by its own stage's IO)."""
        for io in self.ios.values():
            io.posted.clear()
        for pos, a in enumerate(row):
            for b in row[pos : pos + 2]:
                io = self.ios[b.stage]
                if b not in io.posted:
                    io.posted[b] = io.post(b)
            yield a

    def batches(
        self, inputs: Any, targets: Any, needs: tuple[bool, bool], rank: int, loss: bool
    ) -> tuple[list[list[Any]] | None, list[list[Any]] | None]:
        """This replica's micro-batches of the inputs and of the targets, refusing a
        missing one that ``needs`` says a stage here reads: (the model's inputs, the
        targets with a ``loss_fn``, which only the last stage's rank computes). ``loss``:
        a ``loss_fn`` was given; its targets may be ``None`` (a loss of the outputs)."""
        io = next(iter(self.ios.values()))
        mbs = io.split_batch(inputs, "inputs")
        if needs[0] and mbs is None:
            raise InputError(
                f"stages {sorted(self.ios)} read the model's inputs, so rank {rank} needs them",
                remedy="pass the same global batch on every rank",
            )
        if needs[1] and not loss:
            raise InputError(
                "the last stage computes the loss: train_step needs a loss_fn on every rank",
                remedy="call train_step(inputs, targets, loss_fn) with the same loss_fn on "
                "every rank (targets may be None for a loss of the outputs alone)",
            )
        # the targets are one structure: a tuple of them is not a tuple of model inputs
        # (each micro-batch's loss gets the whole structure, cut, as in the local runtime)
        tgts = io.split_batch((targets,), "targets") if needs[1] else None
        return mbs, tgts

    def set_dtypes(self, dtypes: Any) -> None:
        """The wire dtypes under the caller's autocast, for every stage's messages."""
        for io in self.ios.values():
            io.dtypes = dtypes

    def set_split(self, split: bool) -> None:
        """Whether each backward runs as a ``B`` and a later ``W``."""
        for engine in self.engines.values():
            engine.split = split

    def clear(self) -> None:
        """Drop every saved micro-batch (after a step, or a failed one)."""
        for engine in self.engines.values():
            engine.saved.clear()
