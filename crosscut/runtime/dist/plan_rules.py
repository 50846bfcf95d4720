"""Which plans and options the distributed runtime accepts, and how many ranks they take.

Why separate from the executor: these rules read only the plan and the
options (:func:`check_state` also the traced model) — no process group — so
they run first, on every rank alike, and fail with a named rule before any
rank waits on another
(:func:`crosscut.distributed.compile_distributed` calls :func:`check_bn_mode`
before it even traces). The checks that need the other ranks (world size,
same plan everywhere) live with the rank layout in :mod:`crosscut.runtime.dist.world`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn

from crosscut.codegen.state_writes import (
    check_state_writes,
    recompute_honouring_writes,
    split_nodes,
)
from crosscut.errors import DistributedError, InputError
from crosscut.ir.schedule import virtual_stages
from crosscut.partitioner.recompute_choice import recompute_flags_for
from crosscut.runtime.batchnorm import check_sync_batchnorm

__all__ = [
    "check_bn_mode",
    "check_mode",
    "check_one_stage_per_device",
    "check_recompute",
    "check_state",
    "group_widths",
    "recompute_for",
]


def group_widths(plan: Any) -> list[int]:
    """Ranks per stage: the group's size for a channel/batch split, else 1."""
    return [
        len(st.devices) if st.split in ("channel", "batch") and len(st.devices) > 1 else 1
        for st in plan.stages
    ]


def check_state(
    model: nn.Module, gm: fx.GraphModule, plan: Any, replicas: int, microbatches: int, bn_mode: str
) -> None:
    """State written in forward: not once per micro-batch, nor from one share of a batch the
    plan splits over replicas or a batch-split group (``codegen/state_writes.py``); no
    ``nn.SyncBatchNorm``, whose own collectives would span the job's ranks
    (``runtime/batchnorm.py``)."""
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if ready else 1
    check_sync_batchnorm([(model, False)], microbatches, world, frozen_too=True)
    groups = [(st.devices, st.split) for st in plan.stages]
    split = split_nodes(dict(plan.assignment), groups, replicas)
    check_state_writes(model, gm, microbatches, bn_mode, split)


def check_one_stage_per_device(plan: Any) -> None:
    """Ranks are devices: a plan whose stages share a device (a co-located tail) is refused.

    An interleaved plan's stages share devices by design (``V`` per device,
    round-robin or in a V): one rank runs them all, in its schedule row's order.

    Why: the rank layout gives every (stage, member) its own process and device;
    two stages on one device would need two ranks on one GPU, which NCCL does
    not allow, and the solver priced them as taking turns on one device.
    """
    if virtual_stages(str(getattr(plan.options, "schedule", ""))) > 1:
        # interleaved: V stages per device (ir/schedule.placement), one rank running all
        # of them (the plan's own validation holds the placement)
        grouped = [st.index for st in plan.stages if len(st.devices) != 1]
        if grouped:
            raise DistributedError(
                "an interleaved plan runs one device per stage",
                value={"grouped stages": grouped},
                remedy="re-partition with schedule 'auto' or a named non-interleaved one",
            )
        return
    seen: dict[str, int] = {}
    for st in plan.stages:
        for dev in st.devices:
            if dev in seen:
                raise DistributedError(
                    f"stages {seen[dev]} and {st.index} of the plan share device {dev!r} "
                    "(a co-located tail); the distributed runtime runs one rank per device "
                    "and one stage per rank",
                    value=[(s.index, list(s.devices), s.split) for s in plan.stages],
                    remedy="run this plan with the local runtime (crosscut.compile without "
                    "torchrun), or re-partition with cross_shaped=True, colocate=False",
                )
            seen[dev] = st.index


def check_bn_mode(bn_mode: str) -> None:
    """Ranks run bn_mode ``"micro"`` or ``"step"``; ``"exact"`` is local only."""
    if bn_mode not in ("micro", "step"):
        raise InputError(
            "the distributed runtime runs batch norm in bn_mode 'micro' or 'step'",
            value=bn_mode,
            remedy="use bn_mode='step' for whole-batch running statistics, or compile "
            "locally for 'exact'",
        )


def check_recompute(again: bool, stage: int, width: int, split: str) -> None:
    """A stage split over several ranks does not recompute (``again``) under torchrun."""
    if again and width > 1:
        raise InputError(
            f"stage {stage} is split over {width} ranks and cannot recompute "
            "under torchrun: its recomputation would send its group's messages again",
            value={"stage": stage, "width": width, "split": split},
            remedy="recompute only the one-rank stages (a list of flags), or run locally",
        )


def check_mode(lock: tuple[bool, list[str]] | None, training: bool) -> None:
    """Ranks hold one train/eval program: the other mode of a model whose graph reads
    ``self.training`` is refused on every rank alike (``lock``: compiled flag, differences)."""
    if lock is None or training == lock[0]:
        return
    compiled_in = "train" if lock[0] else "eval"
    raise InputError(
        f"this model's forward reads self.training, and ranks under torchrun hold only the "
        f"{compiled_in}-mode program; running it in the other mode would compute something else",
        value=lock[1],
        remedy=f"call .{'train' if lock[0] else 'eval'}() again, compile with mode='train'/"
        "'infer' for the mode you need, or run it locally (crosscut.compile without torchrun "
        "switches programs)",
    )


def recompute_for(model: nn.Module, gm: fx.GraphModule, plan: Any, requested: Any) -> Any:
    """The plan's per-stage recompute choice, or the caller's, checked against parameters
    written in forward (``codegen/state_writes.py``, as the local runtime does): off where
    the plan chose it, refused here, on every rank alike, where the caller asked for it."""
    flags = recompute_flags_for(requested, plan)
    return recompute_honouring_writes(model, gm, dict(plan.assignment), requested, flags)
