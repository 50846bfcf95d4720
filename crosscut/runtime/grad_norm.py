"""The whole model's gradient norm from the pieces a plan holds, as eager computes it.

Why this exists: ``torch.nn.utils.clip_grad_norm_`` scales the gradients it is
given by the norm of those same gradients. On a plan that norm is a sum over
pieces: under torchrun a rank holds one stage (its own norm would clip each
stage by a different factor, silently unlike the model), a batch-split group
member or a replica holds a copy (counted once, not once per copy), and a
channel-split member holds a shard (its piece of one parameter's norm).

Both runtimes hand this module the same description: per parameter piece, the
index of its key in the model's ``state_dict``, whether it is a shard, and its
gradient. :func:`piece_vector` turns the pieces a process owns into one
float64 vector; the torchrun wing sums (or, for the infinity norm, maxes) it
over the ranks; :func:`total_from_vector` reads the model's norm out of it.

Bit for bit where it can be: each whole parameter's norm is computed as eager
computes it (``torch._foreach_norm`` per device and dtype where torch uses it,
else ``torch.linalg.vector_norm``), travels as a float64 (exact for every
float dtype up to float64), and the total is ``vector_norm`` of those norms
stacked in the order eager stacks them (the model's parameter order, grouped by
dtype in order of first appearance). A channel-sharded parameter's norm is
joined from its shards' (``(sum of shard norm ** p) ** (1 / p)``), which rounds
differently from the whole tensor's norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from crosscut.errors import InputError

__all__ = [
    "DTYPES",
    "Piece",
    "checked_norm_type",
    "clip_pieces_",
    "piece_norms",
    "piece_vector",
    "total_from_vector",
]

#: The gradient dtypes a norm can travel as (the code sent is 1 + the index).
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Piece:
    """One parameter piece this process owns: which key, a shard or the whole, its gradient."""

    key_index: int  # index of the parameter's (first) key in the model's state_dict
    shard: bool
    grad: torch.Tensor
    speaks: bool = True  # this piece names the key's dtype (one piece of a key does)


def checked_norm_type(norm_type: float | str) -> float:
    """``norm_type`` as a float: positive, or ``inf``; anything else is refused by name."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        p = float("nan")
    if not (p > 0):
        raise InputError(
            "clip_grad_norm_'s norm_type must be a positive number or inf",
            value=norm_type,
            remedy="pass 2.0 (the default), 1.0 or float('inf')",
        )
    return p


def piece_norms(pieces: Sequence[Piece], norm_type: float, foreach: bool | None) -> list[float]:
    """Each piece's gradient norm, computed as ``torch.nn.utils.get_total_norm`` would."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, piece in enumerate(pieces):
        groups.setdefault((piece.grad.device, piece.grad.dtype), []).append(i)
    out = [0.0] * len(pieces)
    for (device, _dtype), members in groups.items():
        grads = [pieces[i].grad for i in members]
        fast = device.type in ("cpu", "cuda") if foreach is None else foreach
        norms = (
            torch._foreach_norm(grads, norm_type)
            if fast
            else [torch.linalg.vector_norm(g, norm_type) for g in grads]
        )
        # one copy to the host per group (a .item() per tensor would sync a GPU each time)
        for i, norm in zip(members, torch.stack(list(norms)).tolist()):
            out[i] = float(norm)
    return out


def piece_vector(
    pieces: Sequence[Piece], keys: int, norm_type: float, foreach: bool | None
) -> torch.Tensor:
    """A float64 vector of ``3 * keys``: whole norms, shard terms and dtype codes by key.

    A whole parameter's norm goes to ``[k]``; a shard's term to ``[keys + k]``
    (``norm ** p``, to be summed; the norm itself for ``p = inf``, to be maxed);
    the gradient's dtype code to ``[2 * keys + k]`` by the piece that speaks for
    its key (one per key over all processes, so a sum over them keeps the code).
    """
    vec = torch.zeros(3 * keys, dtype=torch.float64)
    for piece, norm in zip(pieces, piece_norms(pieces, norm_type, foreach)):
        k = piece.key_index
        if piece.shard:
            vec[keys + k] += norm if math.isinf(norm_type) else norm**norm_type
        else:
            vec[k] = norm
        if piece.speaks:
            vec[2 * keys + k] = 1 + DTYPES.index(piece.grad.dtype)
    return vec


def total_from_vector(vec: torch.Tensor, norm_type: float, device: torch.device) -> torch.Tensor:
    """The model's gradient norm from a (reduced) :func:`piece_vector`, on ``device``.

    Eager stacks its parameters' norms grouped by dtype, each group in the
    model's order (one device), and takes ``vector_norm`` of the stack; so does this.
    """
    keys = vec.numel() // 3
    values = vec.tolist()
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for k in range(keys):
        code = int(values[2 * keys + k])
        if code <= 0:
            continue
        shard = values[keys + k]
        if math.isinf(norm_type):
            norm = max(values[k], shard)
        else:
            norm = values[k] + (shard ** (1.0 / norm_type) if shard else 0.0)
        dtype = DTYPES[code - 1]
        by_dtype.setdefault(dtype, []).append(torch.tensor(norm, dtype=dtype, device=device))
    if not by_dtype:
        return torch.tensor(0.0, device=device)
    norms = [n for group in by_dtype.values() for n in group]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return total


def clip_pieces_(
    params: Iterable[torch.nn.Parameter],
    pieces: Sequence[Piece],
    keys: int,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    reduce: Callable[[torch.Tensor, bool], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale ``params``' gradients as eager's ``clip_grad_norm_`` would scale the model's.

    ``pieces`` are what this process owns of the model's ``keys`` parameters;
    ``reduce(vector, take_max)`` joins every process's :func:`piece_vector`
    (a sum, or a max for the infinity norm; ``None``: this process holds all).
    Returns the model's total norm, as ``clip_grad_norm_`` does.
    """
    p = checked_norm_type(norm_type)
    vec = piece_vector(pieces, keys, p, foreach)
    if reduce is not None:
        vec = reduce(vec, math.isinf(p))
    device = pieces[0].grad.device if pieces else torch.device("cpu")
    total = total_from_vector(vec.cpu(), p, device)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so "
            "it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(list(params), max_norm, total, foreach)
    return total
