"""Ops that work along the batch dimension while keeping its size: they mix samples.

A batch-split stage runs on shares of the micro-batch, so an op that reads
several samples to compute one (a softmax over dim 0, ``flip(0)``, a
permutation ``x[perm]``, a cumulative sum over the batch) computes something
else on a share. Most such ops change the shape, and the partitioner reads
that from the traced shapes (``partitioner/build.mixes_batch_value``); these
keep it, so they are found from the call itself: a ``dim``/``dims`` argument
that names dim 0 (or ``-ndim``) of a batch-major input, or an index tensor in
the first position of ``x[...]``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

__all__ = ["batch_dim_ops"]


def batch_dim_ops(gm: fx.GraphModule, batch: int) -> set[str]:
    """Names of the nodes of ``gm`` that read their batch-major input along dim 0."""
    if batch <= 1:
        return set()
    out: set[str] = set()
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        first = next((a for a in n.all_input_nodes), None)
        val = first.meta.get("val") if first is not None else None
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or int(val.shape[0]) != batch:
            continue
        if n.target is operator.getitem:
            if _indexes_rows(n.args[1] if len(n.args) > 1 else None):
                out.add(n.name)
            continue
        dims = _dims(n)
        if any(d in (0, -val.dim()) for d in dims):
            out.add(n.name)
    return out


def _indexes_rows(index: Any) -> bool:
    """Whether ``x[index]`` picks rows by a tensor (a permutation, a mask)."""
    lead = index[0] if isinstance(index, tuple) and index else index
    return isinstance(lead, fx.Node) and isinstance(lead.meta.get("val"), torch.Tensor)


def _name(n: fx.Node) -> str:
    return str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")


def _dims(n: fx.Node) -> list[int]:
    """The ``dim``/``dims`` a call passes, as ints (empty: none, or not known)."""
    kwargs = dict(n.kwargs)
    args = tuple(n.args)
    # x.softmax(0) is torch.softmax(x, 0)
    target: Any = getattr(torch, str(n.target), None) if n.op == "call_method" else n.target
    if callable(target):
        try:
            pair = normalize_function(target, args, kwargs, normalize_to_only_use_kwargs=True)
        except Exception:  # no schema, or an ambiguous one: the keywords as given
            pair = None
        if pair is not None:
            kwargs = pair.kwargs
    found: list[int] = []
    # ``dims`` is an axis list for flip and roll only (permute's is an order, tile's counts)
    keys = ("dim", "dims") if _name(n) in ("flip", "roll") else ("dim",)
    for key in keys:
        value = kwargs.get(key)
        items: Iterable[Any] = value if isinstance(value, (list, tuple)) else [value]
        found += [int(v) for v in items if isinstance(v, int) and not isinstance(v, bool)]
    return found
