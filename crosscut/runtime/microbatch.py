"""Splitting a call's inputs into micro-batches (the inverse: ``output_merge.py``).

Every tensor argument (nested structures too) is cut along dim 0 into ``M``
equal parts; a batch not divisible by ``M`` is refused, since equal parts keep
the ``1/M`` loss scaling exact, batch-norm statistics comparable and a
``"mean"`` output merge the batch's mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.errors import InputError

__all__ = ["micro_rows", "scatter"]


def scatter(args: Sequence[Any], microbatches: int) -> list[list[Any]]:
    """Split every tensor in ``args`` (nested structures too) along dim 0 into equal parts.

    Non-tensors are repeated. With one micro-batch the arguments are passed
    through untouched (no views), which keeps that case bit-exact.
    """
    if microbatches == 1:
        return [list(args)]
    leaves, spec = pytree.tree_flatten(list(args))
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise InputError(
            "every tensor argument needs the same batch size along dim 0",
            value=sorted(sizes),
            remedy="pass batch-first tensors of one batch size",
        )
    batch = sizes.pop()
    if batch % microbatches:
        raise InputError(
            f"the batch size must be divisible by the number of micro-batches ({microbatches})",
            value={"batch": batch, "microbatches": microbatches},
            remedy=f"use a batch that is a multiple of {microbatches} or change microbatches",
        )
    parts = [
        t.chunk(microbatches, 0) if isinstance(t, torch.Tensor) and t.dim() > 0 else None
        for t in leaves
    ]
    out: list[list[Any]] = []
    for m in range(microbatches):
        mb = [p[m] if p is not None else leaf for p, leaf in zip(parts, leaves)]
        out.append(list(pytree.tree_unflatten(mb, spec)))
    return out


def micro_rows(args: Sequence[Any]) -> int | None:
    """The samples in one micro-batch: dim 0 of its first batch-major tensor."""
    for t in pytree.tree_leaves(list(args)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None
