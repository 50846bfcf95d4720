"""Splitting a call's inputs into micro-batches (the inverse: ``output_merge.py``).

Every tensor argument (nested structures too) is cut along dim 0 into ``M``
equal parts; a batch not divisible by ``M`` is refused, since equal parts keep
the ``1/M`` loss scaling exact, batch-norm statistics comparable and a
``"mean"`` output merge the batch's mean.

Targets may also be a list with one dict per sample (torchvision's detection
targets: ``[{"boxes": ..., "labels": ...}, ...]``): given the batch size, such a
list is cut into ``M`` consecutive slices, never its dicts' tensors (whose dim 0
counts boxes, not samples). Arguments without a batch-major tensor (``None``
targets of a loss that reads only the outputs) are handed to every micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.errors import InputError

__all__ = ["batch_leaves", "micro_rows", "scatter", "share"]


class _Samples:
    """A per-sample list, kept whole through ``tree_flatten`` and cut by slicing."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def part(self, m: int, parts: int) -> Any:
        k = len(self.items) // parts
        return type(self.items)(self.items[m * k : (m + 1) * k])  # type: ignore[call-arg]


def _per_sample(value: Any, batch: int | None) -> Any:
    """``value`` with each list of ``batch`` dicts (one per sample) wrapped as :class:`_Samples`."""
    if batch is None:
        return value
    if isinstance(value, (list, tuple)):
        if len(value) == batch and value and all(isinstance(v, Mapping) for v in value):
            return _Samples(value)
        items = [_per_sample(v, batch) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value  # nothing per-sample inside: the caller's own object and type
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        inner = {k: _per_sample(v, batch) for k, v in value.items()}
        return value if all(inner[k] is v for k, v in value.items()) else inner
    return value


def scatter(args: Sequence[Any], microbatches: int, batch: int | None = None) -> list[list[Any]]:
    """Split every tensor in ``args`` (nested structures too) along dim 0 into equal parts.

    Non-tensors are repeated. With one micro-batch the arguments are passed
    through untouched (no views), which keeps that case bit-exact. ``batch``
    (the inputs' batch size) lets a per-sample list of dicts be cut by samples.
    """
    if microbatches == 1:
        return [list(args)]
    leaves, spec = pytree.tree_flatten([_per_sample(a, batch) for a in args])
    sizes = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    sizes |= {len(t.items) for t in leaves if isinstance(t, _Samples)}
    if not sizes:  # nothing batch-major (targets=None): every micro-batch gets the same
        return [list(args) for _ in range(microbatches)]
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
        t.chunk(microbatches, 0)
        if isinstance(t, torch.Tensor) and t.dim() > 0
        else [t.part(m, microbatches) for m in range(microbatches)]
        if isinstance(t, _Samples)
        else None
        for t in leaves
    ]
    out: list[list[Any]] = []
    for m in range(microbatches):
        mb = [p[m] if p is not None else leaf for p, leaf in zip(parts, leaves)]
        out.append(list(pytree.tree_unflatten(mb, spec)))
    return out


def batch_leaves(args: Sequence[Any], batch: int) -> list[torch.Tensor]:
    """The batch-major tensors of ``args`` whose dim 0 must be ``batch``: every tensor
    with a dim, except those inside a per-sample list of dicts (their dim 0 counts boxes)."""
    leaves = pytree.tree_leaves([_per_sample(a, batch) for a in args])
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0]


def share(args: Sequence[Any], parts: int, index: int, batch: int) -> list[Any]:
    """``args`` cut to the ``index``-th of ``parts`` equal shares of a ``batch`` of samples
    (a replica's share of the global batch): batch-major tensors on dim 0, a per-sample
    list of dicts by samples, anything else whole."""
    leaves, spec = pytree.tree_flatten([_per_sample(a, batch) for a in args])
    cut = [
        t.chunk(parts, 0)[index]
        if isinstance(t, torch.Tensor) and t.dim() > 0
        else t.part(index, parts)
        if isinstance(t, _Samples)
        else t
        for t in leaves
    ]
    return list(pytree.tree_unflatten(cut, spec))


def micro_rows(args: Sequence[Any]) -> int | None:
    """The samples in one micro-batch: dim 0 of its first batch-major tensor."""
    for t in pytree.tree_leaves(list(args)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    return None
