"""A gradient scaler whose inf/NaN check spans every rank of a distributed pipeline.

``torch.amp.GradScaler`` decides per process whether a step's gradients hold
an inf or a NaN and skips the optimizer step if so. Locally that is right: a
:class:`~crosscut.runtime.local.compiled.CompiledModule`'s ``parameters()`` are
every stage's, so one scaler sees them all. Under torchrun each rank holds
one stage's parameters: a plain scaler on rank 0 would skip a step that
rank 1 takes, the stages would drift apart, and the scales with them.

:class:`PipelineGradScaler` is torch's ``ShardedGradScaler`` (which
all-reduces the found-inf flag over a process group, for FSDP's shards) with
one more allowance: ranks that never call :meth:`scale` — every rank but the
last stage's, since only that one computes the loss — start from the same
initial scale when they first unscale, step or update. Every rank then
unscales by the same scale, skips or steps together, and updates the scale
identically. Use it on every rank::

    scaler = crosscut.distributed.PipelineGradScaler("cpu")   # or "cuda"
    loss = pipe.train_step(x, y, lambda out, t: scaler.scale(loss_fn(out, t)))
    scaler.step(opt)
    scaler.update()
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["PipelineGradScaler"]


class PipelineGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` over the world group, usable on ranks that compute no loss."""

    def _ensure_scale(self) -> None:
        if self._enabled and self._scale is None:
            self._lazy_init_scale_growth_tracker(torch.device(self._device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self._ensure_scale()
        super().unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        self._ensure_scale()
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._ensure_scale()
        super().update(new_scale)
