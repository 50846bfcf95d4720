"""``bn_mode="step"`` on ranks: one batch-norm commit per step, with the global batch's statistics.

Why a reduce: each rank recorded only its own micro-batches (and, in a
batch-split group, its share of each); summing ``[N, Σx, Σx²]`` over the
batch group's members, then over the replicas of this position, gives every
rank the global batch's statistics, so all copies of a stage commit the same
running buffers. Channel-split members hold different channels and reduce
over replicas only. A failed step commits nothing.

Why separate from the executor: which ranks hold the same channels is a
fact of the rank layout, fixed at start-up, and the commit wraps a whole
step; neither is part of the schedule the executor runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from crosscut.runtime.batchnorm import commit_batchnorm, discard_batchnorm
from crosscut.runtime.dist.p2p import Messenger
from crosscut.runtime.dist.world import RankLayout

__all__ = ["StepCommit"]

T = TypeVar("T")


@dataclass(frozen=True)
class StepCommit:
    """Runs a step, then commits (``bn_mode="step"``) or discards its batch-norm records.

    ``peers`` are the (process group, ranks) to sum the statistics over, in
    order: the batch-split group first, then the replicas of this position.
    """

    bn_mode: str
    msg: Messenger
    peers: list[tuple[Any, list[int]]]

    @classmethod
    def for_rank(
        cls,
        bn_mode: str,
        msg: Messenger,
        *,
        layout: RankLayout,
        rank: int,
        split: str,
        device_groups: dict[tuple[int, int], Any],
        position_groups: list[Any],
    ) -> StepCommit:
        """The peers of ``rank``: the ranks holding the same batch-norm channels."""
        replica, stage, _member = layout.role(rank)
        position = rank % layout.per_replica
        peers: list[tuple[Any, list[int]]] = []
        if split == "batch":
            peers.append((device_groups[(replica, stage)], layout.group_ranks(replica, stage)))
        if layout.replicas > 1:
            peers.append((position_groups[position], layout.position_ranks(position)))
        return cls(bn_mode, msg, peers)

    def run(self, stage: nn.Module, step: Callable[[], T]) -> T:
        """``step()``, then commit ``stage``'s statistics once (discard them if it fails)."""
        if self.bn_mode != "step":
            return step()
        try:
            out = step()
        except BaseException:
            discard_batchnorm(stage)
            raise
        commit_batchnorm(stage, reduce=self._reduce() if self.peers else None)
        return out

    def _reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(t: torch.Tensor) -> torch.Tensor:
            for group, ranks in self.peers:
                work = dist.all_reduce(t, group=group, async_op=True)
                self.msg.wait_collective(work, ranks, "the batch-norm statistics all-reduce")
            return t

        return reduce
