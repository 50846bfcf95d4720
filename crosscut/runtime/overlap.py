"""The replicas' gradient all-reduce, overlapped with a stage's last backward.

Why not ``DistributedDataParallel``: DDP decides at forward time which
backward reduces (``no_sync`` around the others), and its reducer then fires
on the very next backward of the module. A pipeline stage runs its micro-batches'
backwards in the schedule's order, interleaved with other forwards (1F1B) or
in reverse (GPipe), so the backward that follows the synced forward is not the
last one and DDP would reduce before every micro-batch's gradient had
arrived. What DDP does inside that backward is kept: gradients are bucketed
(about 25 MB, in the reverse order of the parameters, the order backward
produces them) and each bucket's all-reduce starts, asynchronously, as soon as
its last gradient lands — here during the stage's **last** backward action of
the step, when every other micro-batch has already accumulated.

Numbers: the sum over replicas is the same, then divided by their count, so
the gradients equal the after-backward all-reduce's (:func:`allreduce_mean`)
up to the summation order inside the collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from crosscut.runtime.p2p import Messenger

__all__ = ["BUCKET_BYTES", "OverlappedAllReduce"]

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


class OverlappedAllReduce:
    """Average ``params``' gradients over ``group`` while the armed backward runs."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        group: Any,
        ranks: list[int],
        msg: Messenger,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group, self.ranks, self.msg = group, ranks, msg
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = bucket_bytes  # start a new bucket at once
        for p in reversed(self.params):  # backward reaches the last parameters first
            nbytes = p.numel() * p.element_size()
            if size + nbytes > bucket_bytes and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): b for b, ps in enumerate(self.buckets) for p in ps}
        self._left: list[int] = []
        self._works: dict[int, tuple[torch.Tensor, Any]] = {}
        self._armed = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._landed)  # type: ignore[no-untyped-call]

    def arm(self) -> None:
        """The next backward is the step's last on this stage: reduce as gradients land."""
        self._left = [len(ps) for ps in self.buckets]
        self._works = {}
        self._armed = True

    def _landed(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(p)]
        self._left[b] -= 1
        if self._left[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        grads = []
        for p in self.buckets[b]:
            if p.grad is None:  # unused this step: contributes zeros, as allreduce_mean does
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._works[b] = (flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self) -> None:
        """Start what backward did not (parameters it never reached), wait, average."""
        if not self._armed:
            return
        self._armed = False
        for b in range(len(self.buckets)):
            if b not in self._works:
                self._launch(b)
        for b, (flat, work) in sorted(self._works.items()):
            self.msg.wait_collective(work, self.ranks, "the overlapped gradient all-reduce")
            flat /= len(self.ranks)
            offset = 0
            for p in self.buckets[b]:
                assert p.grad is not None
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._works = {}
