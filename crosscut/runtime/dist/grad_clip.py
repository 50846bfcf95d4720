"""Gradient clipping by the whole model's norm across the ranks of a torchrun job.

Why a rank cannot clip alone: ``torch.nn.utils.clip_grad_norm_(pipe.parameters(), c)``
on a rank sees only the parameters of that rank's stage, so each stage would be
scaled by its own norm's factor, and training would drift from the model's
without an error. :func:`rank_clip_grad_norm_` computes the model's norm from
every rank's pieces (``runtime/grad_norm.py``), each parameter counted once:

* a whole parameter by the lowest rank of replica 0 that holds it (a batch
  group's members and the other replicas hold equal copies once the step's
  gradients are reduced);
* a channel-sharded parameter by every member of replica 0's group, each its
  shard (a replicated scalar by member 0);

then scales every rank's gradients, copies included, by the same factor. Two
small all-reduces over the world (one float per ``state_dict`` key: who holds
what, then the norms), each under the job's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from crosscut.runtime.dist.p2p import Messenger
from crosscut.runtime.dist.state_files import RankState
from crosscut.runtime.grad_norm import Piece, clip_pieces_

__all__ = ["rank_clip_grad_norm_"]


def _all_reduce(
    pipe: RankState, vec: torch.Tensor, op: dist.ReduceOp.RedOpType, what: str
) -> torch.Tensor:
    msg: Messenger = getattr(pipe, "_msg")  # noqa: B009 - the executor's messenger
    rank, world = dist.get_rank(), dist.get_world_size()
    # NCCL reduces device tensors only; gloo takes either
    buf = vec.to(pipe.device) if pipe.device.type == "cuda" else vec.clone()
    work = dist.all_reduce(buf, op=op, async_op=True)
    msg.wait_collective(work, list(range(world)), f"{what} (rank {rank})")
    return buf.cpu()


def _rank_pieces(pipe: RankState) -> list[Piece]:
    """The pieces this rank speaks for, after one all-reduce that elects each key's holder."""
    index = {key: i for i, key in enumerate(pipe.original_keys)}
    rank, world = dist.get_rank(), dist.get_world_size()
    named = pipe.named_original_tensors()
    whole = sorted(
        ((index[key], t) for key, t in named if isinstance(t, nn.Parameter)),
        key=lambda item: item[0],
    )
    holder = torch.full((len(index),), float(world), dtype=torch.float64)
    if pipe.replica == 0:
        for k, _t in whole:
            holder[k] = float(rank)
    holder = _all_reduce(pipe, holder, dist.ReduceOp.MIN, "electing each parameter's holder")
    pieces: list[Piece] = []
    seen: set[int] = set()
    for k, param in whole:  # a tied parameter under its first key, as eager lists it
        if id(param) in seen:
            continue
        seen.add(id(param))
        if int(holder[k]) == rank and param.grad is not None:
            pieces.append(Piece(k, False, param.grad))
    if pipe.replica == 0:
        shards = sorted(pipe.named_shards(), key=lambda item: index[item[0]])
        for key, member, dim, t in shards:
            if id(t) in seen or not isinstance(t, nn.Parameter) or t.grad is None:
                continue
            seen.add(id(t))
            if dim is not None or member == 0:
                pieces.append(Piece(index[key], dim is not None, t.grad, speaks=member == 0))
    return pieces


def rank_clip_grad_norm_(
    pipe: RankState,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``clip_grad_norm_`` of the whole model, called on every rank of the job alike.

    Returns the model's total gradient norm (the same on every rank).
    """

    def reduce(vec: torch.Tensor, take_max: bool) -> torch.Tensor:
        op = dist.ReduceOp.MAX if take_max else dist.ReduceOp.SUM
        return _all_reduce(pipe, vec, op, "the gradient norm's all-reduce")

    pieces = _rank_pieces(pipe)
    return clip_pieces_(
        [param for _name, param in pipe.named_parameters()],
        pieces,
        len(pipe.original_keys),
        max_norm,
        norm_type,
        error_if_nonfinite,
        foreach,
        reduce,
    )
