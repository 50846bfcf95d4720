"""How a batch-split stage cuts its inputs into shares and joins its outputs: one rule.

A batch-split stage runs the same stage on every device of its group, each
on its share of the batch. Two runtimes run such stages — the local one from
threads (:class:`~crosscut.runtime.batch_split.BatchSplitStage`) and the
torchrun one from a rank per device (:class:`~crosscut.runtime.dist.group_members.BatchMember`)
— and they must agree on which inputs are cut, which are copied whole, which
outputs are joined and which are refused, or one runtime would run a plan the
other refuses (they did disagree: the local stage passed a pytree of tensors
to other devices unmoved and accepted a constant output, the torchrun one
copied the pytree and refused the constant). The rule, written once:

* the batch is dim 0 of the first tensor input with a dimension, else of the
  first one inside a tuple input (none: the stage cannot be batch-split);
* an input whose tensors all have the batch as dim 0 — one tensor, or a tuple
  of them such as ``x.chunk(2, dim=1)`` handed over a cut — is cut, tensor by
  tensor (``tensor_split``: the first shares are one row larger when the batch
  does not divide; :func:`split_rows`); any other input that holds tensors
  goes whole to every share; the rest are constants. (A tuple went whole
  before: each share of shufflenet_v2's stage concatenated a whole micro-batch
  with its share, and crashed);
* the group uses ``min(width, batch)`` devices (no empty shares);
* an output must be a tensor whose dim 0 is the batch, or a tuple (list, named
  tuple, dict) of such tensors only: the shares' outputs are concatenated,
  leaf by leaf (:func:`join`). Anything else is refused, at compile time where
  the trace knows the value: a 0-d or otherwise shaped tensor cannot be joined
  without a rule, and a non-tensor (``x.size(0)``, a shape) would be computed
  by each share on its own rows — the leader's ``4`` where the model computed
  ``8``, which a later ``view`` turns into wrong numbers or a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from crosscut.codegen.width import shard_bounds
from crosscut.errors import CodegenError

__all__ = ["batch_of", "check_output", "input_kind", "join", "share_bounds", "split_rows"]


def batch_of(values: Sequence[Any], where: str) -> int:
    """The batch size of a batch-split stage's inputs: dim 0 of the first tensor input with
    a dimension, else of the first such tensor inside a tuple or dict input (a tensor
    argument is the likelier batch: a tuple may hold per-channel statistics)."""
    plain = [v for v in values if isinstance(v, torch.Tensor)]
    for t in [*plain, *(leaf for v in values for leaf in pytree.tree_leaves(v))]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise CodegenError(
        f"{where} needs a batch-major tensor input",
        value=[type(v).__name__ for v in values],
        remedy="split this stage by channel, or do not split it",
    )


def share_bounds(batch: int, width: int) -> list[tuple[int, int]]:
    """``[start, stop)`` rows of each share: ``min(width, batch)`` shares, larger first."""
    return shard_bounds(batch, min(width, batch))


def input_kind(value: Any, batch: int) -> str:
    """``"split"`` (every tensor in it cut by rows), ``"whole"`` (tensors copied whole)
    or ``"const"`` (no tensor)."""
    tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    if tensors and all(_rows(t, batch) for t in tensors):
        return "split"
    return "whole" if tensors else "const"


def split_rows(value: Any, width: int) -> list[Any]:
    """A ``"split"`` input cut into ``width`` shares: each tensor in it by
    ``tensor_split`` on dim 0, anything else in it the same in every share."""
    leaves, spec = pytree.tree_flatten(value)
    cut = [t.tensor_split(width, 0) if isinstance(t, torch.Tensor) else [t] * width for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(width)]


def _rows(t: Any, rows: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0 and int(t.shape[0]) == rows


def check_output(value: Any, rows: int, name: str, where: str) -> None:
    """Refuse an output of a batch-split stage that is not tensors of ``rows`` rows (one,
    or a pytree of them: a model's named tuple of logits and auxiliary logits)."""
    leaves = pytree.tree_leaves(value)
    if leaves and all(_rows(t, rows) for t in leaves):
        return
    tensors = all(isinstance(t, torch.Tensor) for t in leaves)
    what = "not batch-major" if leaves and tensors else "a non-tensor value"
    raise CodegenError(
        f"output {name} of {where} is {what}, so its shares cannot be concatenated "
        "(each share computes it on its own rows)",
        value=repr(value)[:80],
        remedy="cut the stage elsewhere (after the value is used), split it by channel, "
        "or do not split it",
    )


def join(values: Sequence[Any], device: torch.device | str) -> Any:
    """The shares' copies of one output joined into the whole batch's, on ``device``: a
    tensor concatenated on dim 0, a pytree of them leaf by leaf (its structure from the
    first share; :func:`check_output` has checked every share)."""
    flat = [pytree.tree_flatten(v) for v in values]
    spec = flat[0][1]
    leaves = [torch.cat([f[0][i].to(device) for f in flat], 0) for i in range(len(flat[0][0]))]
    return pytree.tree_unflatten(leaves, spec)
