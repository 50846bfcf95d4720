"""Start-up checks, the rank layout and the collectives of the distributed executor.

Why separate from the executor: these are the job-wide agreements — the
world is (plan devices) × replicas in a fixed layout (:class:`RankLayout`),
every rank runs the same plan, each position's replicas share one process
group, start from the same weights and average their gradients, and each
cross-shaped stage's device group has a process group of its own — and each
fails with its own named error before or after the pipeline runs, never
inside it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from crosscut.errors import DistributedError
from crosscut.runtime.dist.p2p import Messenger

__all__ = [
    "RankLayout",
    "allreduce_grads",
    "allreduce_mean",
    "broadcast_from_first",
    "check_initialised",
    "check_same_plan",
    "check_world",
    "make_device_groups",
    "make_position_groups",
    "plan_hash",
    "reached_by_leader",
]


def plan_hash(plan: Any) -> str:
    """A short hash of everything in a plan that decides what runs (not when it was made)."""
    data = plan.to_dict()
    data.pop("created_at", None)
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankLayout:
    """Where every rank sits: ``rank = replica × W + offset[stage] + member``.

    ``widths[k]`` is the size of stage ``k``'s device group (1 for a plain
    pipeline stage) and ``W = sum(widths)`` the ranks of one pipeline replica.
    A group's member 0 is its leader: it holds the stage's whole values and
    is the only member that talks to other stages, so a plan without groups
    keeps today's layout (``rank = replica × S + stage``). ``position`` (the
    rank modulo ``W``) names the same piece of the model in every replica.
    """

    widths: tuple[int, ...]
    replicas: int

    @property
    def per_replica(self) -> int:
        return sum(self.widths)

    @property
    def world_size(self) -> int:
        return self.per_replica * self.replicas

    def offset(self, stage: int) -> int:
        return sum(self.widths[:stage])

    def rank(self, replica: int, stage: int, member: int = 0) -> int:
        return replica * self.per_replica + self.offset(stage) + member

    def role(self, rank: int) -> tuple[int, int, int]:
        """``(replica, stage, member)`` of ``rank``."""
        replica, pos = divmod(rank, self.per_replica)
        for stage, width in enumerate(self.widths):
            if pos < width:
                return replica, stage, pos
            pos -= width
        raise AssertionError("unreachable: position within the replica")

    def group_ranks(self, replica: int, stage: int) -> list[int]:
        """The global ranks of one stage's device group, leader first."""
        return [self.rank(replica, stage, m) for m in range(self.widths[stage])]

    def position_ranks(self, position: int) -> list[int]:
        """The ranks holding the same piece of the model in every replica, replica 0 first."""
        return [r * self.per_replica + position for r in range(self.replicas)]


def check_initialised() -> None:
    """A rank needs an initialised torch.distributed process group before anything else."""
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "a DistributedPipeline needs an initialised torch.distributed process group",
            remedy="call crosscut.distributed.init() first (launch with `crosscut run` "
            "or torchrun)",
        )


def check_world(world_size: int, widths: Sequence[int], replicas: int) -> None:
    """The world must be exactly (sum of group widths) × replicas ranks.

    A plan without device groups needs ``stages × replicas``; a cross-shaped
    plan one rank per plan device of each replica.
    """
    stages = len(widths)
    per = sum(widths)
    need = per * replicas
    if world_size == need:
        return
    fit = world_size // per if world_size % per == 0 and world_size >= per else None
    hint = f" or pass replicas={fit}" if fit else ""
    if per == stages:
        rule = f"the world size must be stages × replicas = {stages} × {replicas} = {need}"
    else:
        rule = (
            f"the world size must be plan devices × replicas = {per} × {replicas} = {need} "
            f"(one rank per device of each stage's group; group widths {list(widths)})"
        )
    raise DistributedError(
        f"{rule}, but {world_size} ranks were started",
        value={
            "world_size": world_size,
            "stages": stages,
            "group_widths": list(widths),
            "replicas": replicas,
        },
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


def make_position_groups(layout: RankLayout, timeout_s: float) -> list[Any]:
    """One process group per position over its replicas (every rank creates every group)."""
    if layout.replicas == 1:
        return []
    return [
        dist.new_group(layout.position_ranks(p), timeout=timedelta(seconds=timeout_s))
        for p in range(layout.per_replica)
    ]


def make_device_groups(layout: RankLayout, timeout_s: float) -> dict[tuple[int, int], Any]:
    """One process group per (replica, stage) whose group is wider than one device.

    ``dist.new_group`` is collective over the whole world, so every rank
    creates every group, in the same order, even those it is not part of.
    """
    out: dict[tuple[int, int], Any] = {}
    for replica in range(layout.replicas):
        for stage, width in enumerate(layout.widths):
            if width > 1:
                out[(replica, stage)] = dist.new_group(
                    layout.group_ranks(replica, stage), timeout=timedelta(seconds=timeout_s)
                )
    return out


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def broadcast_from_first(
    tensors: Sequence[torch.Tensor],
    group: Any,
    ranks: list[int],
    msg: Messenger,
    what: str = "the start-up broadcast of replica 0's parameters",
) -> None:
    """Copy ``ranks[0]``'s tensors to the other ranks (one flattened broadcast per dtype).

    Integer buffers travel too (batch norm's step count), so a member that ran
    fewer forwards than the first one still ends up identical; bool and
    complex tensors (no such state in the models we run) are left alone.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.dtype != torch.bool and not t.is_complex():
            by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = _flat(same)
        work = dist.broadcast(flat, src=ranks[0], group=group, async_op=True)
        msg.wait_collective(work, ranks, what)
        with torch.no_grad():
            _unflat(flat, same)


def allreduce_grads(
    params: Sequence[torch.nn.Parameter],
    group: Any,
    ranks: list[int],
    msg: Messenger,
    *,
    mean: bool,
    what: str = "the gradient all-reduce",
) -> None:
    """Sum (``mean=False``) or average ``.grad`` over the group with one flattened all-reduce.

    Missing gradients count as zeros (and become zero tensors), so every
    member contributes a buffer of the same size.
    """
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flat(grads)
    work = dist.all_reduce(flat, group=group, async_op=True)
    msg.wait_collective(work, ranks, what)
    if mean:
        flat /= len(ranks)
    _unflat(flat, grads)


def allreduce_mean(
    params: Sequence[torch.nn.Parameter], group: Any, ranks: list[int], msg: Messenger
) -> None:
    """Average ``.grad`` over the group (replicas of one position), missing grads as 0."""
    allreduce_grads(params, group, ranks, msg, mean=True)


def reached_by_leader(
    params: Sequence[torch.nn.Parameter], group: Any, ranks: list[int], msg: Messenger, what: str
) -> list[torch.nn.Parameter]:
    """The parameters that hold a gradient on the group's leader (``ranks[0]``), whose
    mask it broadcasts: the ones a batch group's gradient all-reduce must cover. The
    others keep (or get back) ``None`` on every member, as in eager training, where an
    optimizer's weight decay then leaves them.

    Why the leader's: its share's backward starts from the gradients its readers and
    the loss sent, so what it never reached is what eager never reaches (an output no
    loss reads). A member's share gets its gradients from the leader in messages of
    fixed shape, which carry zeros for such an output: its grads there are zeros."""
    if not params:
        return []
    mask = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    mask = mask.to(params[0].device)
    work = dist.broadcast(mask, src=ranks[0], group=group, async_op=True)
    msg.wait_collective(work, ranks, what)
    reached = []
    for p, on_leader in zip(params, mask.tolist()):
        if on_leader:
            reached.append(p)
        else:
            p.grad = None
    return reached
