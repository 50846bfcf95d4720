"""Start-up checks and worker-group collectives of the distributed executor.

Why separate from the executor: these are the job-wide agreements — the
world is stages × replicas, every rank runs the same plan, each stage's
replicas share one process group, start from the same weights and average
their gradients — and each fails with its own named error before or after
the pipeline runs, never inside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from crosscut.errors import DistributedError
from crosscut.runtime.p2p import Messenger

__all__ = [
    "allreduce_mean",
    "broadcast_from_first",
    "check_same_plan",
    "check_world",
    "make_stage_groups",
    "plan_hash",
    "stage_ranks",
]


def plan_hash(plan: Any) -> str:
    """A short hash of everything in a plan that decides what runs (not when it was made)."""
    data = plan.to_dict()
    data.pop("created_at", None)
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_world(world_size: int, stages: int, replicas: int) -> None:
    """The world must be exactly ``stages × replicas`` ranks (rank = replica × S + stage)."""
    need = stages * replicas
    if world_size == need:
        return
    fit = world_size // stages if world_size % stages == 0 else None
    hint = f" or pass replicas={fit}" if fit else ""
    raise DistributedError(
        f"the world size must be stages × replicas = {stages} × {replicas} = {need}, "
        f"but {world_size} ranks were started",
        value={"world_size": world_size, "stages": stages, "replicas": replicas},
        remedy=f"launch {need} processes (`crosscut run --plan PLAN --replicas {replicas} "
        f"script.py` picks the count){hint}",
    )


def check_same_plan(rank: int, world_size: int, mine: dict[str, Any]) -> None:
    """all_gather every rank's plan hash and options; any difference is named by rank."""
    everyone: list[Any] = [None] * world_size
    try:
        dist.all_gather_object(everyone, mine)
    except RuntimeError as exc:
        raise DistributedError(
            f"rank {rank} could not exchange plan hashes with the other ranks: "
            f"{str(exc).splitlines()[0][:300]}",
            remedy="check that every rank started and can reach the rendezvous address",
        ) from exc
    groups: dict[str, list[int]] = {}
    for r, info in enumerate(everyone):
        groups.setdefault(json.dumps(info, sort_keys=True), []).append(r)
    if len(groups) > 1:
        detail = "; ".join(f"ranks {rs} have {k}" for k, rs in groups.items())
        raise DistributedError(
            "every rank must run the same plan (hash), replicas, micro-batches and "
            f"schedule, but they differ: {detail}",
            value={"rank": rank, "mine": mine},
            remedy="give every rank the same plan file and options (crosscut run --plan PLAN "
            "passes one plan to all of them)",
        )


def stage_ranks(stage: int, stages: int, replicas: int) -> list[int]:
    """The global ranks running ``stage``, replica 0 first."""
    return [r * stages + stage for r in range(replicas)]


def make_stage_groups(stages: int, replicas: int, timeout_s: float) -> list[Any]:
    """One process group per stage over its replicas (every rank creates every group)."""
    if replicas == 1:
        return []
    return [
        dist.new_group(stage_ranks(s, stages, replicas), timeout=timedelta(seconds=timeout_s))
        for s in range(stages)
    ]


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_from_first(
    tensors: Sequence[torch.Tensor], group: Any, ranks: list[int], msg: Messenger
) -> None:
    """Copy replica 0's floating tensors to the other replicas (one flattened broadcast)."""
    floats = [t for t in tensors if t.is_floating_point()]
    if not floats:
        return
    flat = _flat(floats)
    work = dist.broadcast(flat, src=ranks[0], group=group, async_op=True)
    msg.wait_collective(work, ranks, "the start-up broadcast of replica 0's parameters")
    with torch.no_grad():
        _unflat(flat, floats)


def allreduce_mean(
    params: Sequence[torch.nn.Parameter], group: Any, ranks: list[int], msg: Messenger
) -> None:
    """Average ``.grad`` over the group with one flattened all-reduce (missing grads are 0)."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flat(grads)
    work = dist.all_reduce(flat, group=group, async_op=True)
    msg.wait_collective(work, ranks, "the gradient all-reduce")
    flat /= len(ranks)
    _unflat(flat, grads)
